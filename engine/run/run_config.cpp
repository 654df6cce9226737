// Parsing of a run's TOML file into its sections' configs.
#include "run/run_config.h"

#include "core/checksum.h"
#include "core/config_file.h"
#include "core/dtype.h"
#include "core/error.h"

#include <algorithm>
#include <filesystem>
#include <map>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

namespace fsdpp {

TrainConfig TrainConfig::from_section(ConfigSection& s) {
  TrainConfig c;
  c.steps = s.get_int("steps", c.steps, 1, kMaxSteps);
  c.grad_accum = s.get_int("grad_accum", c.grad_accum, 1, 1'000'000);
  c.sync_each_micro_batch = s.get_bool("sync_each_micro_batch", c.sync_each_micro_batch);
  c.clip_grad_norm = s.get_double("clip_grad_norm", c.clip_grad_norm, 0, 1e12);
  c.log_every = s.get_int("log_every", c.log_every, 1, kMaxSteps);
  c.eval_every = s.get_int("eval_every", c.eval_every, 0, kMaxSteps);
  c.eval_batches = s.get_int("eval_batches", c.eval_batches, 1, 1'000'000);
  // More intra-op threads than the machine has only makes them wait for each other.
  c.threads = s.get_int("threads", c.threads, 0, std::max(1u, std::thread::hardware_concurrency()));
  c.out_dir = s.get_string("out_dir", c.out_dir);
  c.reuse_out_dir = s.get_bool("reuse_out_dir", c.reuse_out_dir);
  s.finish();
  if (c.out_dir.empty()) s.fail("out_dir", "must not be empty");
  return c;
}

CheckpointConfig CheckpointConfig::from_section(ConfigSection& s, at::ScalarType model_dtype) {
  CheckpointConfig c;
  c.dir = s.get_string("dir", c.dir);
  c.save_every = s.get_int("save_every", c.save_every, 0, kMaxSteps);
  c.save_final = s.get_bool("save_final", c.save_final);
  c.keep = s.get_int("keep", c.keep, 0, 1'000'000);  // 0 keeps every checkpoint
  c.max_gb = s.get_double("max_gb", c.max_gb, 0, 1e9);  // 0: no cap
  const std::string resume = s.get_string("resume", "");
  if (resume == "latest") {
    c.resume.kind = ResumeFrom::Kind::latest;
  } else if (!resume.empty()) {
    c.resume = {.kind = ResumeFrom::Kind::path, .path = resume};
  }
  c.save_on_signal = s.get_bool("save_on_signal", c.save_on_signal);
  c.export_dir = s.get_string("export_dir", c.export_dir);
  c.adapter_dir = s.get_string("adapter_dir", c.adapter_dir);
  // "" as absent: [model] dtype.
  const bool named = !s.get_string("export_dtype", "").empty();
  c.export_dtype = named ? read_dtype(s, "export_dtype", model_dtype) : model_dtype;
  c.export_shard_mb = s.get_double("export_shard_mb", c.export_shard_mb, 0, 1e9);
  s.finish();
  if (!(c.export_shard_mb > 0)) s.fail("export_shard_mb", "must be positive");
  return c;
}

namespace {

// Each section's parser, in the order they run: [checkpoint] reads [model]'s dtype.
using SectionParser = void (*)(ConfigSection&, RunConfig&);
constexpr std::pair<const char*, SectionParser> kSections[] = {
    {"model", [](ConfigSection& s, RunConfig& r) { r.model = ModelSourceConfig::from_section(s); }},
    {"data", [](ConfigSection& s, RunConfig& r) { r.data = DataConfig::from_section(s); }},
    {"optimizer", [](ConfigSection& s, RunConfig& r) { r.optimizer = OptimizerConfig::from_section(s); }},
    {"loss_scale", [](ConfigSection& s, RunConfig& r) { r.loss_scale = LossScaleConfig::from_section(s); }},
    {"scheduler", [](ConfigSection& s, RunConfig& r) { r.scheduler = ScheduleConfig::from_section(s); }},
    {"train", [](ConfigSection& s, RunConfig& r) { r.train = TrainConfig::from_section(s); }},
    {"checkpoint", [](ConfigSection& s, RunConfig& r) { r.checkpoint = CheckpointConfig::from_section(s, r.model.dtype); }},
    {"metrics", [](ConfigSection& s, RunConfig& r) { r.metrics = MetricsConfig::from_section(s); }},
    {"experts", [](ConfigSection& s, RunConfig& r) { r.experts = ExpertsConfig::from_section(s); }},
    {"parallel", [](ConfigSection& s, RunConfig& r) { r.parallel = ParallelConfig::from_section(s); }},
    {"policy", [](ConfigSection& s, RunConfig& r) { r.policy = PolicyConfig::from_section(s); }},
};

// Every key each section reads: what its parser asks an empty file for (the parsers ask for
// all their keys before they check values, so a check that fails on the empty file, such as
// a required path, comes after every key is known).
const std::map<std::string, std::vector<std::string>>& section_keys() {
  static const auto keys = [] {
    const ConfigFile blank = ConfigFile::parse("", "", {});
    std::map<std::string, std::vector<std::string>> out;
    RunConfig scratch;
    for (const auto& [name, parse] : kSections) {
      ConfigSection section = blank.section(name);
      try {
        parse(section, scratch);
      } catch (const UserError&) {
      }
      out[name] = section.asked();
    }
    return out;
  }();
  return keys;
}

}  // namespace

namespace {

// What does not shape the run: where it writes, how often it reports, how long it goes on.
const std::vector<std::string> kNotSettings = {"checkpoint", "metrics", "train.steps", "train.out_dir",
                                               "train.reuse_out_dir", "train.log_every", "train.eval_every",
                                               "train.eval_batches", "train.threads"};

}  // namespace

std::map<std::string, std::string> run_settings(const RunConfig& config) { return config.source.settings(kNotSettings); }

// Over the normalised TOML rather than run_settings: the form earlier runs recorded in
// run.json and their checkpoints, which must go on matching.
std::string config_hash(const RunConfig& config) {
  const std::string text = config.source.canonical_text(kNotSettings);
  return format_crc32c(crc32c(text.data(), text.size()));
}

std::string settings_suffix(const RunConfig& config) {
  const std::string hash = config_hash(config);
  return "-" + hash.substr(hash.find(':') + 1);
}

RunConfig RunConfig::load(const std::filesystem::path& path, const std::vector<std::string>& overrides,
                          const std::string& override_label) {
  return parse(ConfigFile::load(path, overrides, override_label));
}

RunConfig RunConfig::parse(const ConfigFile& file) {
  std::vector<std::string> names;
  for (const auto& [name, parse] : kSections) names.push_back(name);
  file.check_sections(names);
  ConfigFile annotated = file;
  annotated.set_section_keys(section_keys());
  RunConfig run{.file = file.path(), .source = annotated};
  for (const auto& [name, parse] : kSections) {
    ConfigSection section = annotated.section(name);
    parse(section, run);
  }
  // Runs beside each other ([train] reuse_out_dir) keep their checkpoints, models and
  // metrics apart by their settings' hash, where each would replace or truncate the others'
  // (step-N names no run), or, in TensorBoard, show their steps as one series.
  const std::string own = run.train.reuse_out_dir ? settings_suffix(run) : "";
  if (run.checkpoint.dir.empty()) run.checkpoint.dir = run.train.out_dir + "/checkpoints" + own;
  if (run.checkpoint.export_dir.empty()) run.checkpoint.export_dir = run.train.out_dir + "/model" + own;
  if (run.checkpoint.adapter_dir.empty()) run.checkpoint.adapter_dir = run.train.out_dir + "/adapter" + own;
  if (run.metrics.jsonl.empty()) run.metrics.jsonl = run.train.out_dir + "/metrics" + own + ".jsonl";
  if (run.metrics.tensorboard.empty()) run.metrics.tensorboard = run.train.out_dir + "/tensorboard" + own;
  return run;
}

void RunConfig::check_eval_schedule() const {
  if (train.eval_every > 0 && data.eval_fraction == 0) {
    throw UserError(source.where("train", "eval_every") + ": [train] eval_every = " +
                    std::to_string(train.eval_every) + " evaluates the held-out part of [data] train, and "
                    "[data] eval_fraction = 0 holds none out: set eval_fraction, or eval_every = 0");
  }
  if (train.eval_every > 0) check_eval_seq_len();
}

void RunConfig::check_experts(const ModelConfig& model) const {
  experts.check_model(model, source.where("experts", "bias_update_rate"));
}

void RunConfig::check_eval_seq_len() const {
  if (data.seq_len < 2) {
    throw UserError(source.where("data", "seq_len") + ": [data] seq_len = " + std::to_string(data.seq_len) +
                    " leaves an evaluation window no token to predict from an earlier one: evaluation needs 2 or more");
  }
}

void RunConfig::check_paths() const {
  namespace fs = std::filesystem;
  auto check = [&](const char* section, const char* key, const fs::path& path, bool directory) {
    std::error_code error;
    const auto status = fs::status(path, error);
    const bool found = directory ? fs::is_directory(status) : fs::exists(status);
    if (found) return;
    const std::string relative =
        path.is_relative() ? " (relative paths resolve against the working directory " + fs::current_path().string() + ")"
                           : "";
    // resume = "lastest" is a path of that name, and a typo of "latest".
    const bool near_latest = std::string(key) == "resume" && !nearest_name(path.string(), {"latest"}).empty();
    throw UserError(source.where(section, key) + ": [" + section + "] " + key + ": " + path.string() + ": no such " +
                    (directory ? "directory" : "file or directory") + relative +
                    (near_latest ? "; did you mean \"latest\"?" : ""));
  };
  check("model", "path", model.path, false);
  if (!model.adapter.empty()) check("model", "adapter", model.adapter, true);
  if (!data.train.empty()) check("data", "train", data.train, false);
  if (checkpoint.resume.kind == ResumeFrom::Kind::path) check("checkpoint", "resume", checkpoint.resume.path, false);
  if (policy.name.ends_with(".lua") || policy.name.find('/') != std::string::npos) {
    check("policy", "name", policy.name, false);
  }
  // Outputs may be missing, but not unreachable: a loop of links would otherwise fail mid-run
  // in the file system's words.
  for (const auto& [section, key, path] : {std::tuple{"train", "out_dir", train.out_dir},
                                           {"checkpoint", "dir", checkpoint.dir},
                                           {"checkpoint", "export_dir", checkpoint.export_dir},
                                           {"checkpoint", "adapter_dir", checkpoint.adapter_dir}}) {
    std::error_code error;  // set where the path cannot be looked at, not where it is missing
    if (!fs::exists(path, error) && error) {
      throw UserError(source.where(section, key) + ": [" + section + "] " + key + ": " + path + ": " + error.message());
    }
  }
}

void RunConfig::require_data() const {
  if (data.train.empty()) throw UserError(source.where("data", "train") + ": [data] train: required: the token file to train on");
}

}  // namespace fsdpp
