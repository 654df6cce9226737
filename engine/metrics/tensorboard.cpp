// Writing TensorBoard event records.
#include "metrics/tensorboard.h"

#include "core/checksum.h"
#include "core/error.h"
#include "tensorboard_event.pb.h"  // generated from metrics/tensorboard_event.proto

#include <unistd.h>

#include <chrono>
#include <filesystem>

namespace fsdpp {

namespace {

double now_s() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

// The record format's checksum: CRC-32C rotated right by 15 bits plus a constant, so that a
// checksum over data holding checksums stays well distributed.
uint32_t masked_crc32c(const void* data, size_t size) {
  const uint32_t crc = crc32c(data, size);
  return ((crc >> 15) | (crc << 17)) + 0xa282ead8u;
}

std::string event_file_name() {
  char host[256] = {};
  ::gethostname(host, sizeof(host) - 1);
  // TensorBoard finds event files by "tfevents" in the name; time and host keep runs apart.
  return "events.out.tfevents." + std::to_string(static_cast<int64_t>(now_s())) + "." + host + "." +
         std::to_string(::getpid());
}

}  // namespace

TensorBoardWriter::TensorBoardWriter(const std::string& dir, int64_t resumed_after) {
  std::error_code error;
  std::filesystem::create_directories(dir, error);
  path_ = (std::filesystem::path(dir) / event_file_name()).string();
  out_.open(path_, std::ios::binary | std::ios::trunc);
  if (error || !out_) throw UserError(dir + ": cannot write TensorBoard events there");
  tensorboard::Event header;
  header.set_wall_time(now_s());
  header.set_file_version("brain.Event:2");
  write_record(header.SerializeAsString());
  if (resumed_after > 0) {
    tensorboard::Event start;
    start.set_wall_time(now_s());
    start.set_step(resumed_after + 1);
    start.mutable_session_log()->set_status(tensorboard::SessionLog::START);
    write_record(start.SerializeAsString());
  }
}

void TensorBoardWriter::add_scalars(int64_t step, const std::vector<std::pair<std::string, double>>& scalars) {
  tensorboard::Event event;
  event.set_wall_time(now_s());
  event.set_step(step);
  for (const auto& [tag, value] : scalars) {
    auto* v = event.mutable_summary()->add_value();
    v->set_tag(tag);
    v->set_simple_value(static_cast<float>(value));
  }
  write_record(event.SerializeAsString());
}

void TensorBoardWriter::write_record(const std::string& data) {
  const uint64_t length = data.size();  // little-endian on every machine fsdpp builds for
  const uint32_t length_crc = masked_crc32c(&length, sizeof(length));
  const uint32_t data_crc = masked_crc32c(data.data(), data.size());
  out_.write(reinterpret_cast<const char*>(&length), sizeof(length));
  out_.write(reinterpret_cast<const char*>(&length_crc), sizeof(length_crc));
  out_.write(data.data(), static_cast<std::streamsize>(data.size()));
  out_.write(reinterpret_cast<const char*>(&data_crc), sizeof(data_crc));
  out_.flush();
  if (!out_) throw UserError(path_ + ": cannot write TensorBoard events (disk full?)");
}

}  // namespace fsdpp
