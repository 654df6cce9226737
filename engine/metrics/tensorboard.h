// TensorBoard event files, written without TensorFlow: records of serialized Event messages
// (metrics/tensorboard_event.proto), each framed as TensorBoard reads them (a length, the data,
// and a masked CRC-32C of each). Scalars only; apart from LibTorch so protobuf's headers stay
// out of the engine's.
#pragma once

#include <cstdint>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

namespace fsdpp {

class TensorBoardWriter {
 public:
  // Starts a new event file in `dir` (created if missing); UserError naming it when it
  // cannot be written. A run resumed after step `resumed_after` (> 0) starts its session at
  // the next step, so that TensorBoard drops the earlier files' events from there on: the
  // steps it redoes show once, with their new figures.
  explicit TensorBoardWriter(const std::string& dir, int64_t resumed_after = 0);

  // One event at `step` holding a scalar per (tag, value); flushed at once, so a crash loses
  // nothing written before it.
  void add_scalars(int64_t step, const std::vector<std::pair<std::string, double>>& scalars);

  const std::string& path() const { return path_; }

 private:
  void write_record(const std::string& data);

  std::string path_;
  std::ofstream out_;
};

}  // namespace fsdpp
