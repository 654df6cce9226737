// The layout of a token file (scripts/make_tokens.py writes them), little-endian:
// "FSDPTOK\0", u32 version = 1, u32 bytes per token (2 or 4), u64 token count, u64 vocab
// size, then the tokens. Checked from the file's bytes alone, so the check can be fuzzed
// without the rest of the engine.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace fsdpp {

inline constexpr size_t kTokenHeaderBytes = 32;

struct TokenHeader {
  int64_t count = 0;  // tokens after the header
  int64_t vocab = 0;  // every token is below it
  int64_t width = 0;  // bytes per token: 2 or 4

  // Validates a whole file (`size` bytes at `data`): magic, version, width, a count that
  // the file's size holds exactly, a vocabulary in [1, 2^32], and every token inside it (a
  // token past it would index past the embedding table). UserError starting with `where`
  // (and giving the position of the first bad token) otherwise.
  static TokenHeader parse(const std::byte* data, size_t size, const std::string& where);
};

}  // namespace fsdpp
