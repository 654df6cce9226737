// Token file headers and the vocabulary scan.
#include "data/token_header.h"

#include "core/error.h"

#include <cstring>
#include <limits>

namespace fsdpp {

namespace {

constexpr char kMagic[8] = {'F', 'S', 'D', 'P', 'T', 'O', 'K', '\0'};
constexpr size_t kTokenHeaderBytes = 32;  // the fields every version starts with

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

// The fixed fields of both versions, and the sections' places; the sizes must add up to the
// file's exactly (compared in tokens and entries, so no count near 2^64 overflows into a match).
TokenHeader read_layout(const std::byte* data, size_t size, const std::string& where) {
  if (size < 8 || std::memcmp(data, kMagic, 8) != 0) {
    throw UserError(where + ": not an fsdpp token file (bad magic; make one with scripts/make_tokens.py or "
                    "scripts/prepare_data.py)");
  }
  if (size < kTokenHeaderBytes) {
    throw UserError(where + ": the header is cut short (" + std::to_string(size) + " bytes of its " +
                    std::to_string(kTokenHeaderBytes) + "; the file is truncated)");
  }
  uint32_t version = 0, width = 0, flags = 0, zero = 0;
  uint64_t count = 0, vocab = 0, documents = 0;
  std::memcpy(&version, data + 8, 4);
  std::memcpy(&width, data + 12, 4);
  std::memcpy(&count, data + 16, 8);
  std::memcpy(&vocab, data + 24, 8);
  if (version != 1 && version != 2) {
    throw UserError(where + ": token file version " + std::to_string(version) + " is not supported (1 or 2)");
  }
  if (width != 2 && width != 4) throw UserError(where + ": bytes per token " + std::to_string(width) + " (expected 2 or 4)");
  size_t offset = kTokenHeaderBytes;
  if (version == 2) {
    if (size < kTokenHeaderBytes + 16) throw UserError(where + ": truncated version 2 header");
    std::memcpy(&documents, data + 32, 8);
    std::memcpy(&flags, data + 40, 4);
    std::memcpy(&zero, data + 44, 4);
    if (flags > 1 || zero != 0) {
      throw UserError(where + ": unknown header flags " + std::to_string(flags) + " and " + std::to_string(zero) +
                      " (expected 0 or 1, and 0)");
    }
    offset += 16;
  }
  // Bytes per token over every section: the tokens, a mask byte, and the document ends.
  const uint64_t token_bytes = width + (flags & 1);
  const uint64_t body = size - offset;
  const bool fits = count <= body / token_bytes && documents <= (body - count * token_bytes) / 8 &&
                    body == count * token_bytes + documents * 8;
  if (!fits) {
    throw UserError(where + ": truncated or padded token file: header says " + std::to_string(count) + " tokens of " +
                    std::to_string(width) + " bytes" + (flags & 1 ? " with a mask byte each" : "") + " and " +
                    std::to_string(documents) + " document ends, file has " + std::to_string(size) + " bytes");
  }
  if (vocab < 1 || vocab > (uint64_t{1} << 32)) {
    throw UserError(where + ": header vocabulary " + std::to_string(vocab) + " is not in [1, 2^32]");
  }
  if (version == 2 && count > 0 && documents == 0) throw UserError(where + ": tokens but no document ends");
  TokenHeader h{version, static_cast<int64_t>(count), static_cast<int64_t>(vocab), width,
                static_cast<int64_t>(documents), (flags & 1) != 0};
  h.tokens_offset = offset;
  h.ends_offset = offset + count * width;
  h.mask_offset = h.ends_offset + documents * 8;
  return h;
}

void check_tokens(const std::byte* data, const TokenHeader& h, const std::string& where) {
  const std::byte* tokens = data + h.tokens_offset;
  const auto vocab = static_cast<uint64_t>(h.vocab);
  const int64_t bad = h.width == 2 ? first_outside<uint16_t>(tokens, h.count, vocab)
                                   : first_outside<uint32_t>(tokens, h.count, vocab);
  if (bad >= 0) {
    uint32_t token = 0;
    std::memcpy(&token, tokens + bad * h.width, h.width);
    throw UserError(where + ": the token at position " + std::to_string(bad) + " is " + std::to_string(token) +
                    ", outside the header's vocabulary of " + std::to_string(vocab));
  }
}

void check_documents(const std::byte* data, const TokenHeader& h, const std::string& where) {
  uint64_t previous = 0;
  for (int64_t d = 0; d < h.documents; ++d) {
    uint64_t end = 0;
    std::memcpy(&end, data + h.ends_offset + d * 8, 8);
    const bool last = d + 1 == h.documents;
    if (end <= previous || end > static_cast<uint64_t>(h.count) || (last && end != static_cast<uint64_t>(h.count))) {
      throw UserError(where + ": document " + std::to_string(d) + " ends at token " + std::to_string(end) +
                      " (ends must increase from 1 to the token count " + std::to_string(h.count) + ")");
    }
    previous = end;
  }
  if (!h.has_mask) return;
  for (int64_t i = 0; i < h.count; ++i) {
    const auto flag = static_cast<uint8_t>(data[h.mask_offset + i]);
    if (flag > 1) {
      throw UserError(where + ": the mask byte of token " + std::to_string(i) + " is " + std::to_string(flag) +
                      " (0 or 1)");
    }
  }
}

}  // namespace

TokenHeader TokenHeader::parse(const std::byte* data, size_t size, const std::string& where) {
  const TokenHeader h = read_layout(data, size, where);
  check_tokens(data, h, where);
  check_documents(data, h, where);
  return h;
}

}  // namespace fsdpp
