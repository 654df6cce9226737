// Fuzzes a Hugging Face config.json: every architecture the registry knows, vision towers,
// RoPE scaling, and sizes a run could never hold.
#include "fuzz_case.h"
#include "models/model_config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  return fsdpp::fuzz_case([&] { fsdpp::ModelConfig::from_text(fsdpp::fuzz_text(data, size), "config.json"); });
}
