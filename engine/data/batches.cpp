// Choosing a run's batches.
#include "data/batches.h"

#include "core/error.h"
#include "data/data.h"
#include "data/multimodal_data.h"
#include "data/packed_documents.h"

#include <filesystem>

namespace fsdpp {

std::unique_ptr<Batches> open_batches(const DataConfig& config, const ModelConfig& model, BatchUse use) {
  if (std::filesystem::is_directory(config.train)) {
    // A directory of anything else (a model, the folder a token file lies in) is no dataset:
    // said so before what a dataset would need of the model or of train_on.
    if (!std::filesystem::exists(std::filesystem::path(config.train) / "samples.jsonl")) {
      throw UserError(config.train + ": a directory without samples.jsonl; [data] train names a token file "
                      "(scripts/make_tokens.py, scripts/prepare_data.py) or a multimodal dataset directory "
                      "(samples.jsonl and pixels.safetensors, scripts/make_multimodal.py)");
    }
    return std::make_unique<MultimodalSamples>(
        MultimodalDataset::open(config.train, model, config.seq_len, config.train_on), config);
  }
  auto tokens = std::make_shared<const TokenFile>(TokenFile::open(config.train));
  if (tokens->vocab_size() > model.vocab_size) {
    throw UserError(tokens->path().string() + ": token vocabulary " + std::to_string(tokens->vocab_size()) +
                    " exceeds the model's vocab_size " + std::to_string(model.vocab_size));
  }
  if (tokens->documents() > 0) return std::make_unique<PackedDocuments>(std::move(tokens), config);
  if (!config.packing) {
    throw UserError(tokens->path().string() + ": [data] packing = false gives each document a row, and this file "
                    "is one stream without document ends (write one with scripts/prepare_data.py)");
  }
  return std::make_unique<TokenWindows>(std::move(tokens), config, use == BatchUse::train);
}

}  // namespace fsdpp
