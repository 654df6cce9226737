// Parsing of a run's TOML file into its sections' configs.
#include "run/run_config.h"

#include "core/config_file.h"
#include "core/dtype.h"
#include "core/error.h"

#include <algorithm>
#include <thread>

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

RunConfig RunConfig::load(const std::filesystem::path& path, const std::vector<std::string>& overrides) {
  return parse(ConfigFile::load(path, overrides));
}

RunConfig RunConfig::parse(const ConfigFile& file) {
  file.check_sections({"model", "data", "optimizer", "scheduler", "train", "checkpoint", "metrics", "experts", "parallel",
                      "policy"});
  RunConfig run{.file = file.path(), .source = file};
  auto section = [&file](const char* name) { return file.section(name); };
  auto model = section("model");
  run.model = ModelSourceConfig::from_section(model);
  auto data = section("data");
  run.data = DataConfig::from_section(data);
  auto optimizer = section("optimizer");
  run.optimizer = OptimizerConfig::from_section(optimizer);
  auto scheduler = section("scheduler");
  run.scheduler = ScheduleConfig::from_section(scheduler);
  auto train = section("train");
  run.train = TrainConfig::from_section(train);
  auto checkpoint = section("checkpoint");
  run.checkpoint = CheckpointConfig::from_section(checkpoint, run.model.dtype);
  auto metrics = section("metrics");
  run.metrics = MetricsConfig::from_section(metrics);
  auto experts = section("experts");
  run.experts = ExpertsConfig::from_section(experts);
  auto parallel = section("parallel");
  run.parallel = ParallelConfig::from_section(parallel);
  auto policy = section("policy");
  run.policy = PolicyConfig::from_section(policy);
  if (run.checkpoint.dir.empty()) run.checkpoint.dir = run.train.out_dir + "/checkpoints";
  if (run.checkpoint.export_dir.empty()) run.checkpoint.export_dir = run.train.out_dir + "/model";
  if (run.checkpoint.adapter_dir.empty()) run.checkpoint.adapter_dir = run.train.out_dir + "/adapter";
  if (run.metrics.jsonl.empty()) run.metrics.jsonl = run.train.out_dir + "/metrics.jsonl";
  if (run.metrics.tensorboard.empty()) run.metrics.tensorboard = run.train.out_dir + "/tensorboard";
  return run;
}

}  // namespace fsdpp
