// Fuzzes a sharded checkpoint's metadata.json (as a forger would write it, its checksum
// file rewritten to match).
#include "fuzz_case.h"
#include "io/checkpoint_metadata.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  return fsdpp::fuzz_case([&] { fsdpp::CheckpointMetadata::parse(fsdpp::fuzz_text(data, size)); });
}
