// The layout of a token file, little-endian. Every version starts with "FSDPTOK\0", u32
// version, u32 bytes per token (2 or 4), u64 token count and u64 vocab size.
//   version 1 (scripts/make_tokens.py): the tokens follow; one stream, every token a target.
//   version 2 (scripts/prepare_data.py): u64 document count, u32 flags (bit 0: a loss mask
//     follows), u32 zero; then the tokens; then each document's end as a u64 token offset
//     (increasing, the last one the token count); then, with the flag, one byte per token,
//     1 where the token is a training target and 0 where it is context only (a prompt).
// Checked from the file's bytes alone, so the check can be fuzzed without the rest of the
// engine.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace fsdpp {

struct TokenHeader {
  int64_t version = 1;
  int64_t count = 0;      // tokens
  int64_t vocab = 0;      // every token is below it
  int64_t width = 0;      // bytes per token: 2 or 4
  int64_t documents = 0;  // version 2: documents the tokens hold (0: one unbroken stream)
  bool has_mask = false;  // version 2: a loss mask byte per token
  size_t tokens_offset = 0, ends_offset = 0, mask_offset = 0;  // where each section starts

  // Validates a whole file (`size` bytes at `data`): magic, version, width, sections whose
  // sizes add up to the file's exactly, a vocabulary in [1, 2^32], every token inside it (a
  // token past it would index past the embedding table), document ends that increase up to
  // the token count, and mask bytes of 0 or 1. UserError starting with `where` (and giving
  // the position of the first bad entry) otherwise.
  static TokenHeader parse(const std::byte* data, size_t size, const std::string& where);
};

}  // namespace fsdpp
