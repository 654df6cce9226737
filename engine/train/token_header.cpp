// Token file headers and the vocabulary scan.
#include "train/token_header.h"

#include "core/error.h"

#include <cstring>
#include <limits>

namespace fsdpp {

namespace {

constexpr char kMagic[8] = {'F', 'S', 'D', 'P', 'T', 'O', 'K', '\0'};

// The position of the first of `count` tokens of type T at `data` that is >= vocab, or -1.
template <typename T>
int64_t first_outside(const std::byte* data, int64_t count, uint64_t vocab) {
  // A width that cannot hold a value at or past the vocabulary needs no scan.
  if (vocab > std::numeric_limits<T>::max()) return -1;
  for (int64_t i = 0; i < count; ++i) {
    T token;
    std::memcpy(&token, data + i * sizeof(T), sizeof(T));
    if (token >= vocab) return i;
  }
  return -1;
}

}  // namespace

TokenHeader TokenHeader::parse(const std::byte* data, size_t size, const std::string& where) {
  if (size < kTokenHeaderBytes || std::memcmp(data, kMagic, 8) != 0) {
    throw UserError(where + ": not an fsdpp token file (bad magic; make one with scripts/make_tokens.py)");
  }
  uint32_t version = 0, width = 0;
  uint64_t count = 0, vocab = 0;
  std::memcpy(&version, data + 8, 4);
  std::memcpy(&width, data + 12, 4);
  std::memcpy(&count, data + 16, 8);
  std::memcpy(&vocab, data + 24, 8);
  if (version != 1) throw UserError(where + ": token file version " + std::to_string(version) + " is not supported");
  if (width != 2 && width != 4) throw UserError(where + ": bytes per token " + std::to_string(width) + " (expected 2 or 4)");
  // Compared in tokens, so a count near 2^64 cannot overflow into a match.
  const uint64_t held = (size - kTokenHeaderBytes) / width;
  if (count != held || (size - kTokenHeaderBytes) % width != 0) {
    throw UserError(where + ": truncated or padded token file: header says " + std::to_string(count) +
                    " tokens, file has " + std::to_string(size) + " bytes (" + std::to_string(held) +
                    " tokens of " + std::to_string(width) + " bytes after the header)");
  }
  if (vocab < 1 || vocab > (uint64_t{1} << 32)) {
    throw UserError(where + ": header vocabulary " + std::to_string(vocab) + " is not in [1, 2^32]");
  }
  const TokenHeader header{static_cast<int64_t>(count), static_cast<int64_t>(vocab), width};
  const std::byte* tokens = data + kTokenHeaderBytes;
  const int64_t bad = width == 2 ? first_outside<uint16_t>(tokens, header.count, vocab)
                                 : first_outside<uint32_t>(tokens, header.count, vocab);
  if (bad >= 0) {
    uint32_t token = 0;
    std::memcpy(&token, tokens + bad * width, width);
    throw UserError(where + ": the token at position " + std::to_string(bad) + " is " + std::to_string(token) +
                    ", outside the header's vocabulary of " + std::to_string(vocab));
  }
  return header;
}

}  // namespace fsdpp
