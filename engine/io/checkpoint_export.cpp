// The export streams tensor by tensor: the HF writer plans its files from the recorded
// shapes, and each tensor is assembled from its shards, written and dropped.
#include "io/checkpoint_export.h"

#include "core/dtype.h"
#include "io/hf_dir.h"
#include "io/sharded_checkpoint.h"
#include "models/model_config.h"

#include <ATen/ATen.h>

namespace fsdpp {

ExportSummary export_checkpoint(const std::filesystem::path& dir, const std::filesystem::path& out,
                                std::optional<at::ScalarType> dtype, size_t max_shard_bytes) {
  const ShardedCheckpoint checkpoint = ShardedCheckpoint::open(dir);
  const ModelConfig config = ModelConfig::from_file(checkpoint.verified("config.json"));
  const at::ScalarType out_dtype =
      dtype.value_or(parse_dtype(checkpoint.metadata().value("model", nlohmann::json::object()).value("dtype", "float32")));
  constexpr std::string_view kPrefix = "model/";
  std::vector<TensorSpec> specs;
  for (const auto& key : checkpoint.keys(std::string(kPrefix))) {
    specs.push_back({key.substr(kPrefix.size()), out_dtype, checkpoint.record(key).shape});
  }
  HfDirWriter writer(config, specs, out, out_dtype, max_shard_bytes);
  ExportSummary summary{checkpoint.step(), 0, 0};
  for (const auto& spec : specs) {
    writer.write(spec.name, checkpoint.read_full(std::string(kPrefix) + spec.name));
    ++summary.tensors;
    summary.bytes += spec.bytes();
  }
  writer.finish();
  return summary;
}

}  // namespace fsdpp
