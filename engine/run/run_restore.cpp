// Restoring a run from a sharded checkpoint (run/run_checkpoint.h): at start, where
// [checkpoint] resume names one (the parameters' rows are read as the run shards, the
// optimizer's, generator's and data position's here), or on a caller's load, which makes
// sure on every rank that the checkpoint fits this run before it reads a row.
#include "run/run_checkpoint.h"

#include "run/run.h"

#include "core/error.h"
#include "core/log.h"
#include "data/data.h"
#include "fsdp/fsdp_state.h"
#include "io/peft_adapter.h"
#include "io/sharded_checkpoint.h"
#include "models/lora.h"
#include "models/model_config.h"
#include "optim/lr_schedule.h"
#include "run/out_dir.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <mutex>
#include <set>
#include <unordered_set>

namespace fsdpp {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

// Where a checkpoint leaves `rank`: its step, the loop's figures, and the caller's loop state
// of rank `rank` % the saved world (as the generators carry over to another size).
ResumePoint resume_point(const json& meta, int rank) {
  ResumePoint point{meta.at("step").get<int64_t>(), meta.value("client_state", json::object()).get<ClientState>()};
  const json states = meta.value("loop_states", json::array());
  if (!states.empty()) {
    const json& mine = states.at(static_cast<size_t>(rank) % states.size());
    if (!mine.is_null()) point.loop_state = mine.dump();
  }
  return point;
}

// The adapters' fields that shape their weights and optimizer state (not where a policy
// declared them, nor their dropout), as a checkpoint records them; null for none.
json lora_shape(const json& lora) {
  if (!lora.is_object()) return json();
  json shape;
  for (const char* field : {"targets", "rank", "alpha", "trainable"}) shape[field] = lora.value(field, json());
  return shape;
}

// "LoRA adapters of rank 8, alpha 16 on 14 modules (q_proj, k_proj, ...), training lm_head":
// one line whatever the model's size.
std::string lora_text(const json& shape) {
  if (shape.is_null()) return "no LoRA adapters";
  std::set<std::string> kinds;  // the targets' last names
  for (const auto& target : shape["targets"]) {
    const auto name = target.get<std::string>();
    kinds.insert(name.substr(name.rfind('.') + 1));
  }
  std::string text = "LoRA adapters of rank " + shape["rank"].dump() + ", alpha " + shape["alpha"].dump() + " on " +
                     std::to_string(shape["targets"].size()) + " modules (";
  for (const auto& kind : kinds) text += (text.ends_with("(") ? "" : ", ") + kind;
  text += ")";
  if (!shape["trainable"].empty()) {
    text += ", training";
    for (const auto& module : shape["trainable"]) text += " " + module.get<std::string>();
  }
  return text;
}

// A checkpoint's data position carries over only to the same stream of windows.
void check_data_position(const json& saved, const json& data, const std::string& where) {
  if (saved.is_null()) {
    throw UserError(where + ": cannot resume this run's data: the checkpoint was saved by a run fed by its caller, "
                            "with no data position");
  }
  if (!saved.is_object()) throw UserError(where + "/metadata.json: data must be an object, got " + saved.dump());
  const auto counted = [](const json& identity) {
    return identity.contains("documents") ? "rows of whole documents" : "windows of a token stream";
  };
  if (saved.contains("documents") != data.contains("documents")) {
    throw UserError(where + ": cannot resume: its data position counts " + counted(saved) + ", but this run's data " +
                    data.value("train", std::string()) + " gives " + counted(data) +
                    " (a token file with document ends is read by its documents)");
  }
  // Every field of the stream's identity but the batch size, which slices the same stream: a
  // packed stream's documents, rows and packing too (a changed split or packing lays its rows
  // out anew). The position itself is the saved one's alone.
  std::set<std::string> keys;
  for (const json* identity : {&saved, &data}) {
    for (const auto& [key, value] : identity->items()) keys.insert(key);
  }
  for (const char* key : {"batch_size", "epoch", "window"}) keys.erase(key);
  // Checkpoints older than the token file's fingerprint carry none to compare.
  if (!saved.contains("contents")) keys.erase("contents");
  constexpr const char* kWayOn =
      "; to go on from its weights over other data, name the checkpoint as [model] path (its optimizer state left "
      "behind)";
  if (keys.contains("contents") && saved.value("train", json()) == data.value("train", json()) &&
      saved.at("contents") != data.value("contents", json())) {
    throw UserError(where + ": cannot resume: " + data.value("train", std::string()) + " changed since the checkpoint (" +
                    saved.at("contents").dump() + " then, " + data.value("contents", json()).dump() +
                    " now): the same window index would name other tokens" + kWayOn);
  }
  for (const std::string& key : keys) {
    if (saved.value(key, json()) != data.value(key, json())) {
      throw UserError(where + ": cannot resume: its data position counts windows of a stream with " + key + " = " +
                      saved.value(key, json()).dump() + ", but this run has " + data.value(key, json()).dump() +
                      " (the same window index would name different tokens)" + kWayOn);
    }
  }
}

}  // namespace

ResumePoint Run::resume() {
  check_trains("resume");
  const ResumePoint point = checkpoint_ ? restore(*checkpoint_) : ResumePoint{};
  if (comm_->rank() == 0) record_run(config_);
  return point;
}

// [train] steps is how long a run goes on, no setting of its own, but the decay of the learning
// rate spans it: a resume that moves the end moves the rates of the steps after the saved one.
void Run::warn_schedule_change(const json& meta, int64_t step, const std::string& where) const {
  const int64_t planned = meta.value("scheduler", json::object()).value("total_steps", int64_t{0});
  if (planned <= 0 || planned == config_.train.steps || comm_->rank() != 0) return;
  const LrSchedule before(config_.scheduler, config_.optimizer.lr, planned);
  const LrSchedule now(config_.scheduler, config_.optimizer.lr, config_.train.steps);
  for (int64_t s = step + 1; s <= config_.train.steps; ++s) {  // the first step whose rate moves
    if (before.at(s) == now.at(s)) continue;
    log_warn(where, ": [train] steps ", planned, " -> ", config_.train.steps, " moves the learning-rate schedule's end: ",
             "step ", s, " takes ", now.at(s), " where the run as saved would have taken ", before.at(s));
    return;
  }
}

ResumePoint Run::restore(const ShardedCheckpoint& checkpoint) {
  const json& meta = checkpoint.metadata();
  const std::string where = checkpoint.dir().string();
  const json& saved = meta.at("data");
  if (batches_) check_data_position(saved, batches_->identity(), where);
  if (meta.value("config_hash", "") != config_hash(config_) && meta.contains("settings") && comm_->rank() == 0) {
    auto saved_settings = meta.value("settings", json::object()).get<std::map<std::string, std::string>>();
    auto settings = run_settings(config_);
    // A run fed rows by its caller (the Python API) reads no [data] and runs no micro-batch
    // loop of its own: what those keys said of the run that saved matters no more.
    if (!batches_) {
      const auto loop_only = [](const auto& entry) {
        return entry.first.starts_with("data.") || entry.first == "train.grad_accum" ||
               entry.first == "train.sync_each_micro_batch";
      };
      std::erase_if(saved_settings, loop_only);
      std::erase_if(settings, loop_only);
    }
    if (saved_settings != settings) {
      log_warn(where, ": resuming with other settings than it was saved with: ", settings_change(saved_settings, settings));
    }
  }
  const ResumePoint point = resume_point(meta, comm_->rank());
  warn_schedule_change(meta, point.step, where);
  restore_optimizer(checkpoint);
  if (batches_) {
    ShuffledOrder& order = batches_->order();
    const auto window = saved.at("window").get<int64_t>();
    if (window > static_cast<int64_t>(order.size())) {
      throw UserError(where + "/metadata.json: data.window " + std::to_string(window) + " is outside an epoch of " +
                      std::to_string(order.size()) + " windows");
    }
    order.seek({saved.at("epoch").get<uint64_t>(), window});
  }
  const ReadStats read = checkpoint.read_stats();
  const double rebuild_s = std::chrono::duration<double>(Clock::now() - built_from_).count();
  log_info("resume: rank ", comm_->rank(), " read ", read.bytes, " bytes of ", where, " (saved at world ",
           checkpoint.world_size(), ") in ", read.seconds, " s (",
           static_cast<double>(read.bytes) / std::max(read.seconds, 1e-9) / 1e9, " GB/s; ", rebuild_s,
           " s to rebuild the run); continuing after step ", point.step);
  return point;
}

ResumePoint Run::load(const fs::path& dir) {
  check_trains("load");
  check_not_offloaded("load");
  check_outside_backward("load");
  // Each rank opens the checkpoint and reads its own rows of other ranks' files: one rank's
  // failure (a path or a file missing on its node, a corrupt one) is made every rank's, so
  // that none goes on to a collective the others never reach.
  std::optional<ShardedCheckpoint> checkpoint;
  on_every_rank("load", dir.string(), "", [&] {
    if (!ShardedCheckpoint::is_checkpoint(dir)) {
      throw UserError(dir.string() + " is not a complete checkpoint (no metadata.json with its " +
                      kMetadataChecksumFile + ")");
    }
    checkpoint.emplace(ShardedCheckpoint::open(dir));
    check_fits(*checkpoint);
    // An adapter-only checkpoint's base must be this run's: rank 0 reads the base's files, and
    // on_every_rank makes its answer every rank's.
    const json saved = checkpoint->metadata().value("model", json::object());
    if (saved.contains("base") && comm_->rank() == 0) {
      saved["base"].get<BaseIdentity>().check_same(base_identity_of(config_.model),
                                                   checkpoint->dir().string());
    }
    verify_reads(*checkpoint);
  });
  optimizer_->settle();   // the last step's host updates would write over the loaded rows
  fsdp_->reshard_all();  // the kept cast shards hold the old values; copies may still read them
  // What fails from here (a file changed since its check, a forged record) leaves rows of both
  // states: the run refuses to train or save on such a mixture until a load completes.
  partly_loaded_from_ = dir;
  on_every_rank("load", dir.string(), " (the run is now partly loaded)", [&] {
    at::NoGradGuard no_grad;
    for (auto& s : fsdp_->shard_rows()) {
      if (checkpoint->contains("model/" + s.name)) checkpoint->read_rows("model/" + s.name, s.rows, s.first_row);
    }
    restore_optimizer(*checkpoint);
  });
  partly_loaded_from_.reset();
  return resume_point(checkpoint->metadata(), comm_->rank());
}

void Run::check_same_adapters(const ShardedCheckpoint& checkpoint) const {
  const std::string where = checkpoint.dir().string();
  const json saved = checkpoint.metadata().value("model", json::object());
  const json saved_lora = lora_shape(saved.value("lora", json()));
  const json lora = lora_shape(loaded_.lora ? json(*loaded_.lora) : json());
  if (saved_lora != lora) {
    std::string differ;
    if (!saved_lora.is_null() && !lora.is_null()) {
      for (const auto& [field, value] : lora.items()) {
        if (saved_lora[field] != value) differ += (differ.empty() ? " (other " : ", ") + field;
      }
      differ += ")";
    }
    throw UserError(where + ": holds " + lora_text(saved_lora) + ", where this run has " + lora_text(lora) + differ);
  }
}

void Run::check_fits(const ShardedCheckpoint& checkpoint) const {
  check_same_adapters(checkpoint);
  const std::string where = checkpoint.dir().string();
  const json saved = checkpoint.metadata().value("model", json::object());
  // A model of the same shapes may still compute otherwise (its heads split anew, its RoPE
  // rebased): a checkpoint resumes the model it saved.
  const auto changed = ModelConfig::from_file(checkpoint.verified("config.json")).differences(model().config());
  if (!changed.empty()) {
    std::string fields;
    for (const auto& field : changed) fields += (fields.empty() ? "" : ", ") + field;
    throw UserError(where + ": saved another model than this run's [model] " + config_.model.path + " (" +
                    fields + " from the checkpoint's config.json to this run's)");
  }
  const std::vector<ShardRows> shards = fsdp_->shard_rows();
  std::unordered_set<std::string> names;  // a MoE model holds tens of thousands of tensors
  for (const auto& s : shards) names.insert(s.name);
  for (const auto& key : checkpoint.keys("model/")) {
    const std::string name = key.substr(sizeof("model/") - 1);
    if (!names.contains(name)) {
      throw UserError(where + ": holds a tensor '" + name + "' that this run's model has not (another architecture)");
    }
  }
  for (const auto& s : shards) {
    const std::string key = "model/" + s.name;
    if (!checkpoint.contains(key)) {
      // An adapter-only checkpoint leaves its frozen base out, which must then be this run's.
      if (saves(s) || !saved.contains("base")) throw UserError(where + ": holds no tensor '" + s.name + "'");
      continue;
    }
    if (checkpoint.record(key).shape != s.full_shape) {
      throw UserError(where + ": tensor '" + s.name + "' is " + c10::str(c10::IntArrayRef(checkpoint.record(key).shape)) +
                      " there but " + c10::str(c10::IntArrayRef(s.full_shape)) + " in this run (another architecture)");
    }
    // Refused here, before any row is written, rather than when the optimizer's turn comes.
    for (const auto& [moment, field] : kSavedMoments) {
      if (s.rows.requires_grad() && !checkpoint.contains(std::string(moment) + "/" + s.name)) {
        throw UserError(where + ": holds no optimizer state for '" + s.name + "', which this run trains and the "
                        "saved run did not (frozen there: [policy.options] freeze, or a LoRA base); resume with the "
                        "settings it was saved with, or start from its export as [model] path");
      }
    }
  }
}

void Run::verify_reads(const ShardedCheckpoint& checkpoint) const {
  for (const auto& s : fsdp_->shard_rows()) {
    const int64_t rows = s.rows.dim() == 0 ? 1 : s.rows.size(0);
    if (checkpoint.contains("model/" + s.name)) checkpoint.verify_rows("model/" + s.name, s.first_row, rows);
    for (const auto& [moment, field] : kSavedMoments) {
      const std::string key = std::string(moment) + "/" + s.name;
      if (checkpoint.contains(key)) checkpoint.verify_rows(key, s.first_row, rows);
    }
  }
  const std::string rank_file = rank_file_name(comm_->rank() % checkpoint.world_size());  // restore_rng's
  if (checkpoint.lists_file(rank_file)) checkpoint.verified(rank_file);
}

void Run::restore_optimizer(const ShardedCheckpoint& checkpoint) {
  at::NoGradGuard no_grad;
  const auto adam_steps = static_cast<double>(checkpoint.metadata().at("optimizer").at("steps").get<int64_t>());
  for (auto& s : fsdp_->shard_rows()) {
    if (auto state = optimizer_->state_of(s.rows)) {
      for (const auto& [key, field] : kSavedMoments) {  // check_fits found them all
        at::Tensor rows = (*state).*field;  // shares the state's storage: read in place
        checkpoint.read_rows(std::string(key) + "/" + s.name, rows, s.first_row);
      }
      state->step.fill_(adam_steps);
    }
  }
  restore_loss_scale(checkpoint);
  restore_rng(checkpoint);
}

void Run::restore_loss_scale(const ShardedCheckpoint& checkpoint) {
  if (!scaler_) return;
  const json saved = checkpoint.metadata().value("loss_scale", json());
  if (saved.is_null()) {  // saved by a run that did not scale its loss
    if (comm_->rank() == 0) log_info("loss scale: ", checkpoint.dir().string(), " holds none; starting from ", scaler_->scale());
    return;
  }
  const json scale = saved.is_object() ? saved.value("scale", json()) : json();
  const json tracker = saved.is_object() ? saved.value("growth_tracker", json()) : json();
  if (!scale.is_number() || !(scale.get<double>() > 0) || !std::isfinite(scale.get<double>()) ||
      !tracker.is_number_integer() || tracker.get<int64_t>() < 0) {
    throw UserError(checkpoint.dir().string() + "/metadata.json: loss_scale must hold a positive finite scale and a "
                    "growth_tracker >= 0, got " + saved.dump());
  }
  scaler_->restore({.scale = scale.get<double>(), .growth_tracker = tracker.get<int64_t>()});
  if (comm_->rank() == 0) {
    log_info("loss scale: ", scaler_->scale(), " from ", checkpoint.dir().string(), " (", tracker.get<int64_t>(),
             " finite steps toward growth)");
  }
}

void Run::restore_rng(const ShardedCheckpoint& checkpoint) const {
  // Each rank's own generator when the world matches; otherwise the saved rank it maps to.
  const int source = comm_->rank() % checkpoint.world_size();
  at::Tensor rng = checkpoint.read_whole(rank_file_name(source), "rng/cpu");
  if (!rng.defined()) return;
  at::Generator generator = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(generator.mutex());
  try {
    generator.set_state(rng);
  } catch (const c10::Error&) {
    throw CorruptCheckpoint(checkpoint.dir().string() + "/" + rank_file_name(source) +
                            ": rng/cpu is not a generator state (the file is corrupt)", checkpoint.dir());
  }
}

std::optional<fs::path> resume_path(const RunConfig& config) {
  const ResumeFrom& resume = config.checkpoint.resume;
  if (resume.kind == ResumeFrom::Kind::fresh) return std::nullopt;
  if (resume.kind == ResumeFrom::Kind::latest) return latest_of_this_run(config);
  if (!ShardedCheckpoint::is_checkpoint(resume.path)) {
    throw UserError("[checkpoint] resume: " + resume.path.string() +
                    " is not a complete checkpoint (no metadata.json with its metadata.crc32c)");
  }
  return resume.path;
}

}  // namespace fsdpp
