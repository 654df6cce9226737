// Fuzzes model.safetensors.index.json, whose file names must stay inside the directory.
#include "fuzz_case.h"
#include "io/weight_index.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  return fsdpp::fuzz_case(
      [&] { fsdpp::parse_weight_map(fsdpp::fuzz_text(data, size), "model.safetensors.index.json"); });
}
