// CRC-32C (Castagnoli), the checksum every checkpoint file carries: hardware-accelerated on
// x86-64 with SSE4.2, so verifying a checkpoint costs little next to reading it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace fsdpp {

// Continues the checksum `crc` (0 to start) over `size` bytes.
uint32_t crc32c(const void* data, size_t size, uint32_t crc = 0);

// "crc32c:" followed by eight lower-case hex digits, as metadata records it.
std::string format_crc32c(uint32_t crc);

}  // namespace fsdpp
