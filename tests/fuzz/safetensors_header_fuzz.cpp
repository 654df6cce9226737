// Fuzzes the safetensors header parser with whole files: lengths, dtypes, shapes, offsets.
#include "fuzz_case.h"
#include "io/safetensors_header.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  return fsdpp::fuzz_case([&] {
    fsdpp::SafetensorsHeader::parse(reinterpret_cast<const std::byte*>(data), size, "model.safetensors");
  });
}
