// The [data] section: which token file (or multimodal dataset) to train on and how it is
// cut into batches.
#pragma once

#include <cstdint>
#include <string>

namespace fsdpp {

class ConfigSection;

// The most tokens one global batch may hold (batch_size x seq_len): 2^32, far above what a
// step can hold in memory, and far from where sizes overflow.
inline constexpr int64_t kMaxBatchTokens = int64_t{1} << 32;

// Which tokens are training targets.
enum class TrainOn {
  all,         // every token after the first of a window
  completion,  // only those the token file's loss mask marks (assistant turns, completions), or
               // those after a multimodal sample's prompt_length
};

// What becomes of a document longer than a row (a token file with document ends).
enum class LongDocumentRule {
  split,     // cut into pieces of seq_len tokens, each attending within itself
  truncate,  // its first seq_len + 1 tokens alone, as SFT trainers truncate
  drop,      // left out
};

struct DataConfig {
  std::string train;           // token file to train on; "" for a run fed rows by its caller (Python)
  int64_t seq_len = 512;       // tokens per sequence (each window holds seq_len + 1)
  int64_t batch_size = 8;      // sequences per micro-batch
  double eval_fraction = 0.0;  // share of the file's tail held out for evaluation
  uint64_t seed = 0;           // batch order
  bool shuffle = true;         // false visits windows (or multimodal samples) in file order
  TrainOn train_on = TrainOn::all;  // "all" or "completion" (a token file's loss mask; samples' prompts)
  // A token file with document ends (version 2): true packs several documents into each row,
  // attention never crossing from one to another; false gives each document a padded row.
  bool packing = true;
  LongDocumentRule long_documents = LongDocumentRule::split;  // "split", "truncate" or "drop"

  static DataConfig from_section(ConfigSection& section);
};

}  // namespace fsdpp
