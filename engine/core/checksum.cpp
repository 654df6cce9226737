// CRC-32C with the SSE4.2 instruction where the CPU has it, else a table per byte.
#include "core/checksum.h"

#include <array>
#include <cstdio>
#include <cstring>

#if defined(__x86_64__)
#include <nmmintrin.h>
#endif

namespace fsdpp {

namespace {

constexpr uint32_t kPolynomial = 0x82F63B78u;  // reflected Castagnoli polynomial

std::array<uint32_t, 256> make_table() {
  std::array<uint32_t, 256> table{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c >> 1) ^ ((c & 1u) ? kPolynomial : 0u);
    table[i] = c;
  }
  return table;
}

uint32_t crc32c_portable(const unsigned char* p, size_t size, uint32_t crc) {
  static const std::array<uint32_t, 256> table = make_table();
  for (size_t i = 0; i < size; ++i) crc = table[(crc ^ p[i]) & 0xFFu] ^ (crc >> 8);
  return crc;
}

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) uint32_t crc32c_sse42(const unsigned char* p, size_t size, uint32_t crc) {
  uint64_t c = crc;
  for (; size >= 8; size -= 8, p += 8) {
    uint64_t word;
    std::memcpy(&word, p, 8);
    c = _mm_crc32_u64(c, word);
  }
  uint32_t c32 = static_cast<uint32_t>(c);
  for (; size > 0; --size, ++p) c32 = _mm_crc32_u8(c32, *p);
  return c32;
}
#endif

}  // namespace

uint32_t crc32c(const void* data, size_t size, uint32_t crc) {
  const auto* p = static_cast<const unsigned char*>(data);
  crc = ~crc;
#if defined(__x86_64__)
  static const bool has_sse42 = __builtin_cpu_supports("sse4.2");
  crc = has_sse42 ? crc32c_sse42(p, size, crc) : crc32c_portable(p, size, crc);
#else
  crc = crc32c_portable(p, size, crc);
#endif
  return ~crc;
}

std::string format_crc32c(uint32_t crc) {
  char text[20];
  std::snprintf(text, sizeof text, "crc32c:%08x", crc);
  return text;
}

}  // namespace fsdpp
