// Saving a run, and its final export (restoring it: run/run_restore.cpp). The save order is
// the same on every rank: rank 0 prepares the staging directory; every rank writes its file;
// two all-gathers bring rank 0 every file's size and checksum and every shard's rows; rank 0
// writes the metadata, renames the staging directory into place and rotates. An all-reduce
// after each of the three writing phases tells every rank whether one failed.
#include "run/run_checkpoint.h"

#include "run/run.h"

#include "core/checksum.h"
#include "core/dtype.h"
#include "core/error.h"
#include "core/failpoint.h"
#include "core/log.h"
#include "core/module_tree.h"
#include "data/data.h"
#include "fsdp/fsdp_state.h"
#include "io/hf_export.h"
#include "io/peft_adapter.h"
#include "io/sharded_checkpoint.h"
#include "models/lora.h"
#include "run/out_dir.h"
#include "run/outputs.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>
#include <chrono>
#include <exception>
#include <limits>
#include <mutex>

namespace fsdpp {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

using Clock = std::chrono::steady_clock;

// The save's time and size, and its slowest rank's rate from that rank's own bytes and
// seconds (staging to its file's commit). `files`: [world, 3] bytes, checksum, microseconds.
void log_saved(int64_t step, const fs::path& dir, const at::Tensor& files, double seconds, size_t removed) {
  int64_t total = 0;
  int64_t slowest = 0;
  double slowest_rate = 0;
  for (int64_t r = 0; r < files.size(0); ++r) {
    const auto bytes = files[r][0].item<int64_t>();
    const double rate = static_cast<double>(bytes) / std::max(1e-9, files[r][2].item<double>() / 1e6) / 1e9;
    total += bytes;
    if (r == 0 || rate < slowest_rate) slowest = r, slowest_rate = rate;
  }
  log_info("checkpoint: step ", step, " saved to ", dir.string(), " in ", seconds, " s: ", total, " bytes from ",
           files.size(0), " rank(s); slowest rank ", slowest, " wrote ", files[slowest][0].item<int64_t>(),
           " bytes in ", files[slowest][2].item<double>() / 1e6, " s (", slowest_rate, " GB/s)",
           removed == 0 ? std::string() : concat("; removed ", removed, " older"));
}

}  // namespace

void to_json(json& j, const ClientState& state) {
  j = {{"skipped_steps", state.skipped_steps}, {"tokens_seen", state.tokens_seen}, {"loss", state.loss}};
}

void from_json(const json& j, ClientState& state) {
  state.skipped_steps = j.value("skipped_steps", int64_t{0});
  state.tokens_seen = j.value("tokens_seen", int64_t{0});
  // A loss that was not finite is saved as null.
  const json loss = j.value("loss", json(0.0));
  state.loss = loss.is_null() ? std::numeric_limits<double>::quiet_NaN() : loss.get<double>();
}

void Run::warn_unread_mlp_adapters(const LoraPlan& lora, const std::string& dir) const {
  if (!model().config().moe) return;
  const auto on_mlp = std::find_if(lora.targets.begin(), lora.targets.end(), [](const std::string& path) {
    return path.ends_with("gate_proj") || path.ends_with("up_proj") || path.ends_with("down_proj");
  });
  if (on_mlp == lora.targets.end()) return;
  log_warn("adapter: ", dir, " adapts ", *on_mlp, ", an MLP projection of a mixture-of-experts model: peft over "
           "transformers 5 reads every gate_proj, up_proj and down_proj target of such a model as its fused experts' "
           "and drops these adapters without an error; fsdpp reads the adapter as written, and `fsdpp export "
           "CHECKPOINT OUT --merge-lora` gives the model transformers loads");
}

bool Run::saves(const ShardRows& shard) const { return !loaded_.lora || shard.rows.requires_grad(); }

void Run::save(int64_t step, const ClientState& state, const fs::path& root, const std::string& loop_state) {
  check_trains("save");
  check_loaded("save");
  optimizer_->settle();  // the last step's host updates of the rows about to be written
  const fs::path final_dir = checkpoint_path(root, step);
  if (fs::exists(final_dir)) {  // the same on every rank: a step is saved once
    // Beside another run ([train] reuse_out_dir), its checkpoint of this step is not ours.
    if (!of_this_run(config_, final_dir)) {
      throw EveryRankError(final_dir.string() + ": holds another run's checkpoint of step " + std::to_string(step) +
                           ", which this run's would replace; choose another [checkpoint] dir");
    }
    return;
  }
  if (const auto later = later_of_this_run(config_, root, step)) {
    throw EveryRankError("save: " + later->string() + " is a later checkpoint of this run than step " +
                         std::to_string(step) + " (the run went back to an earlier one): a restart's resume = "
                         "\"latest\" would take it, and rotation would delete this save as the oldest; save "
                         "elsewhere, or move the later ones away");
  }
  const fs::path staging = staging_path(root, step);
  const int rank = comm_->rank();
  const auto start = Clock::now();
  // Each phase ends with every rank told whether one failed (a directory it cannot make, a
  // full disk): each raises its one line, and none waits on a collective for a rank that left.
  on_every_rank("save", root.string(), "", [&] {
    if (rank != 0) return;
    clear_partial_checkpoints(root);
    // Leftovers clear_partial_checkpoints could not remove are no place to save into.
    if (fs::exists(staging)) {
      throw UserError(staging.string() + ": left by an earlier save, and it cannot be removed; remove it by hand");
    }
    fs::create_directories(staging);
  });

  const std::vector<ShardRows> shards = fsdp_->shard_rows();
  at::Tensor mine;
  on_every_rank("save", staging.string(), "", [&] { mine = write_rank_file(staging, shards, start); });
  at::Tensor files = at::empty({comm_->size() * 3}, at::kLong);
  comm_->all_gather(files, mine);
  std::vector<int64_t> my_rows;  // per parameter: first row, rows
  for (const auto& shard : shards) {
    my_rows.push_back(shard.first_row);
    my_rows.push_back(shard.primary && saves(shard) ? shard.rows.size(0) : 0);
  }
  at::Tensor rows = at::empty({comm_->size() * static_cast<int64_t>(my_rows.size())}, at::kLong);
  comm_->all_gather(rows, at::tensor(my_rows, at::kLong));
  const std::vector<std::string> loop_states = comm_->all_gather_texts(loop_state);

  std::vector<fs::path> removed;
  on_every_rank("save", final_dir.string(), "", [&] {
    if (rank != 0) return;
    removed = commit(metadata(step, state, shards, files.view({-1, 3}), rows.view({comm_->size(), -1, 2}), loop_states),
                     staging, root, final_dir);
  });
  if (rank == 0) {
    log_saved(step, final_dir, files.view({-1, 3}), std::chrono::duration<double>(Clock::now() - start).count(),
              removed.size());
  }
}

at::Tensor Run::write_rank_file(const fs::path& staging, const std::vector<ShardRows>& shards,
                                Clock::time_point start) const {
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  for (const auto& s : shards) {
    if (!s.primary || s.rows.size(0) == 0 || !saves(s)) continue;
    tensors.emplace_back("model/" + s.name, s.rows);
    if (auto state = optimizer_->state_of(s.rows)) {
      for (const auto& [key, field] : kSavedMoments) tensors.emplace_back(std::string(key) + "/" + s.name, (*state).*field);
    }
  }
  {
    at::Generator generator = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(generator.mutex());
    tensors.emplace_back("rng/cpu", generator.get_state());
  }
  std::vector<TensorSpec> specs;
  for (const auto& [key, t] : tensors) specs.push_back({key, t.scalar_type(), t.sizes().vec()});
  SafetensorsWriter writer(staging / rank_file_name(comm_->rank()), specs);
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (i == tensors.size() / 2) {
      failpoint("checkpoint-mid-write");
      failpoint_error("checkpoint-write-error");
    }
    writer.write(tensors[i].second);
  }
  writer.commit();
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  return at::tensor({static_cast<int64_t>(writer.size()), static_cast<int64_t>(writer.checksum()),
                     static_cast<int64_t>(seconds * 1e6)}, at::kLong);
}

std::vector<fs::path> Run::commit(json meta, const fs::path& staging, const fs::path& root,
                                  const fs::path& final_dir) const {
  const json& raw = model().config().raw ? *model().config().raw : json::object();
  const std::string config_text = raw.dump(2) + "\n";
  write_file_atomically(staging / "config.json", config_text.data(), config_text.size());
  meta["files"]["config.json"] = {{"bytes", config_text.size()},
                                  {"checksum", format_crc32c(crc32c(config_text.data(), config_text.size()))}};
  const std::string text = meta.dump(1) + "\n";
  write_file_atomically(staging / "metadata.json", text.data(), text.size());
  const std::string sum = format_crc32c(crc32c(text.data(), text.size())) + "\n";
  write_file_atomically(staging / kMetadataChecksumFile, sum.data(), sum.size());
  fsync_directory(staging);
  failpoint("checkpoint-before-commit");
  fs::rename(staging, final_dir);
  fsync_directory(root);
  // Beside another run ([train] reuse_out_dir), its checkpoints are not this run's to rotate.
  return rotate_checkpoints(root, config_.checkpoint.keep, static_cast<uintmax_t>(config_.checkpoint.max_gb * 1e9),
                            [&](const CheckpointEntry& c) { return of_this_run(config_, c.path); });
}

json Run::metadata(int64_t step, const ClientState& state, const std::vector<ShardRows>& shards,
                   const at::Tensor& files, const at::Tensor& rows, const std::vector<std::string>& loop_states) const {
  const int world = comm_->size();
  json meta = {{"format", kCheckpointFormat}, {"version", 1},    {"step", step}, {"world_size", world},
               {"meshes", fsdp_->mesh_shapes()}, {"config_hash", config_hash(config_)},
               {"settings", run_settings(config_)}};
  for (int r = 0; r < world; ++r) {
    meta["files"][rank_file_name(r)] = {{"bytes", files[r][0].item<int64_t>()},
                                        {"checksum", format_crc32c(static_cast<uint32_t>(files[r][1].item<int64_t>()))}};
  }
  std::optional<int64_t> adam_steps;
  for (size_t i = 0; i < shards.size(); ++i) {
    const ShardRows& s = shards[i];
    if (!saves(s)) continue;
    json saved = json::array();
    for (int r = 0; r < world; ++r) {
      const auto count = rows[r][static_cast<int64_t>(i)][1].item<int64_t>();
      if (count > 0) saved.push_back({{"file", rank_file_name(r)}, {"rows", {rows[r][static_cast<int64_t>(i)][0].item<int64_t>(), count}}});
    }
    auto record = [&](const std::string& key, at::ScalarType dtype) {
      meta["tensors"][key] = {{"dtype", safetensors_dtype_name(dtype)}, {"shape", s.full_shape}, {"shards", saved}};
    };
    record("model/" + s.name, s.rows.scalar_type());
    if (auto moments = optimizer_->state_of(s.rows)) {
      for (const auto& [key, field] : kSavedMoments) record(std::string(key) + "/" + s.name, ((*moments).*field).scalar_type());
      const auto steps = static_cast<int64_t>(moments->step.item<float>());
      TORCH_CHECK(!adam_steps || *adam_steps == steps, "AdamW step counts differ between parameters");
      adam_steps = steps;
    }
  }
  meta["optimizer"] = {{"name", "adamw"}, {"steps", adam_steps.value_or(0)}};
  meta["scheduler"] = {{"step", step}, {"total_steps", config_.train.steps}};
  // Runs that share an out_dir by choice are told apart by their settings alone.
  meta["run"] = {{"out_dir", config_.train.reuse_out_dir ? std::string() : canonical_out_dir(config_)}};
  meta["model"] = {{"dtype", dtype_name(config_.model.dtype)}, {"source", model_files_.string()}};
  if (loaded_.lora) {
    meta["model"]["lora"] = *loaded_.lora;
    meta["model"]["base"] = *base_;  // rank 0's, which alone writes the metadata
  }
  meta["data"] = nullptr;  // a run fed by its caller has no data position
  if (batches_) {
    const auto position = batches_->order().position();
    meta["data"] = batches_->identity();
    meta["data"]["epoch"] = position.epoch;
    meta["data"]["window"] = position.window;
  }
  meta["client_state"] = state;
  // Per rank, null where a rank saved none; left out where none did (the binary's own loop).
  if (std::any_of(loop_states.begin(), loop_states.end(), [](const auto& s) { return !s.empty(); })) {
    json& saved = meta["loop_states"] = json::array();
    for (const auto& text : loop_states) saved.push_back(text.empty() ? json(nullptr) : json::parse(text));
  }
  if (scaler_) {
    meta["loss_scale"] = {{"scale", scaler_->state().scale}, {"growth_tracker", scaler_->state().growth_tracker}};
  }
  return meta;
}


void Run::on_every_rank(const std::string& what, const std::string& subject, const std::string& after,
                        const std::function<void()>& work) {
  std::string failure;
  try {
    work();
  } catch (const UserError& e) {  // names its file already
    failure = what + ": " + e.what();
  } catch (const std::exception& e) {
    failure = what + ": " + subject + ": " + first_line(e.what());
  }
  const std::optional<int> refusing = first_refusing_rank(!failure.empty());
  if (!failure.empty()) throw EveryRankError(failure + after);
  if (refusing) {
    throw EveryRankError(what + ": " + subject + ": " + kAnotherRankFailed + " (its error says why)" + after);
  }
}

std::optional<int> Run::first_refusing_rank(bool refused_here) {
  if (comm_->size() == 1) return refused_here ? std::optional<int>(0) : std::nullopt;
  at::Tensor refused = at::zeros({comm_->size()}, at::kLong);  // [world]
  if (refused_here) refused[comm_->rank()] = 1;
  comm_->all_reduce_sum(refused);
  const auto first = static_cast<int>(refused.argmax().item<int64_t>());
  return refused[first].item<int64_t>() > 0 ? std::optional<int>(first) : std::nullopt;
}


void Run::check_disk_room(int nodes) {
  const CheckpointConfig& saves = config_.checkpoint;
  OutputSizes sizes{.nodes = nodes};
  const size_t master_bytes = c10::elementSize(master_dtype(config_.model.dtype));
  const size_t export_bytes = c10::elementSize(saves.export_dtype);
  for (const auto& s : fsdp_->shard_rows()) {
    const auto numel = static_cast<uint64_t>(c10::multiply_integers(s.full_shape));
    if (s.primary && s.rows.requires_grad()) sizes.checkpoint += numel * master_bytes * 3;
    // A LoRA run's export at the end is its adapter, which the checkpoint's size bounds.
    if (saves.save_final && !loaded_.lora) sizes.exported += numel * export_bytes;
  }
  const int64_t start = checkpoint_ ? checkpoint_->step() : 0, steps = config_.train.steps;
  if (saves.save_every > 0) sizes.saves = steps / saves.save_every - start / saves.save_every;
  if (saves.save_final && (saves.save_every == 0 || steps % saves.save_every != 0)) ++sizes.saves;
  std::string refused;
  if (comm_->rank() == 0) {
    try {
      check_room_for_outputs(config_, sizes);
    } catch (const UserError& e) {
      refused = e.what();
    }
  }
  const std::optional<int> first = first_refusing_rank(!refused.empty());
  if (!refused.empty()) throw UserError(refused);
  if (first) throw EveryRankError("rank 0 found no room on disk for the run's outputs (its error says where)");
}

void Run::export_final(int64_t step) {
  optimizer_->settle();  // the last step's host updates of the values about to be written
  const int rank = comm_->rank();
  const CheckpointConfig& config = config_.checkpoint;
  if (const auto& lora = loaded_.lora) {  // the base is frozen: fsdpp export --merge-lora merges it
    NamedTensors tensors;  // small next to the base: held whole until written
    fsdp_->for_each_full_parameter([&](const std::string& name, const at::Tensor& t) {
      const bool trainable = std::any_of(lora->trainable.begin(), lora->trainable.end(),
                                         [&](const std::string& m) { return path_under(name, m); });
      if (rank == 0 && (is_adapter_parameter(name) || trainable)) {
        tensors.emplace_back(name, t.to(at::kCPU, t.scalar_type(), /*non_blocking=*/false, /*copy=*/true));
      }
    });
    if (rank != 0) return;
    write_peft_adapter(config.adapter_dir, *lora, config_.model.path, model().config().model_type, tensors,
                       adapter_in_own_run_dir_);
    warn_unread_mlp_adapters(*lora, config.adapter_dir);
    log_info("saved the LoRA adapter at step ", step, " to ", config.adapter_dir);
    return;
  }
  // Rank 0 streams each tensor to disk as its unit's gather delivers it: no rank ever holds
  // the whole model.
  const auto max_shard_bytes = static_cast<size_t>(config.export_shard_mb * (1 << 20));
  std::unique_ptr<HfDirWriter> writer;
  // The directory was checked at start; refused now (the run wrote into it meanwhile), every
  // rank stops before the gathers rather than wait there for rank 0.
  const std::string saved = " (the last step's checkpoint is saved; fsdpp export can write it elsewhere)";
  on_every_rank("export", config.export_dir, saved, [&] {
    if (rank != 0) return;
    std::vector<TensorSpec> specs;
    const auto written = written_dtypes(model(), config.export_dtype);
    for (const auto& r : fsdp_->shard_rows()) specs.push_back({r.name, written.at(r.name), r.full_shape});
    writer = std::make_unique<HfDirWriter>(model().config(), specs, config.export_dir, config.export_dtype,
                                           max_shard_bytes, model_files_, export_in_own_run_dir_);
  });
  // A tensor rank 0 cannot write stops its writing, not its part in the gathers the other
  // ranks wait in; every rank learns of it once the last unit is gathered.
  std::exception_ptr failed;
  fsdp_->for_each_full_parameter([&](const std::string& name, const at::Tensor& t) {
    if (!writer || failed) return;
    try {
      writer->write(name, t);
    } catch (const std::exception&) {
      failed = std::current_exception();
    }
  });
  on_every_rank("export", config.export_dir, saved, [&] {
    if (failed) std::rethrow_exception(failed);
    if (writer) writer->finish();
  });
  if (writer) log_info("exported the model at step ", step, " to ", config.export_dir);
}

}  // namespace fsdpp
