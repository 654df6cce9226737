// Fuzzes token files whole: the header against the file's size, and every token against
// the header's vocabulary.
#include "data/token_header.h"
#include "fuzz_case.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  return fsdpp::fuzz_case([&] { fsdpp::TokenHeader::parse(reinterpret_cast<const std::byte*>(data), size, "train.tok"); });
}
