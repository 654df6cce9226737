// Fuzzes token files whole: the header against the file's size, and every token against
// the header's vocabulary.
#include "fuzz_case.h"
#include "train/token_header.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  return fsdpp::fuzz_case([&] { fsdpp::TokenHeader::parse(reinterpret_cast<const std::byte*>(data), size, "train.tok"); });
}
