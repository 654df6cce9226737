// The fsdpp binary: runs the command cli/arguments.h parsed. Every user error is one line on
// stderr and exit status 2; an engine fault is one line and status 1.
#include "bindings/lua/policy.h"
#include "cli/arguments.h"
#include "core/cpu_kernels.h"
#include "core/device.h"
#include "core/error.h"
#include "core/log.h"
#include "core/module_tree.h"
#include "data/batches.h"
#include "data/data.h"
#include "data/evaluate.h"
#include "distributed/comm.h"
#include "distributed/dist_env.h"
#include "distributed/launcher.h"
#include "fsdp/plan_text.h"
#include "io/hf_dir.h"
#include "io/model_source.h"
#include "io/safetensors.h"
#include "io/sharded_checkpoint.h"
#include "models/lora.h"
#include "models/registry.h"
#include "run/checkpoint_export.h"
#include "run/outputs.h"
#include "run/train_loop.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <optional>
#include <iostream>
#include <new>
#include <string>
#include <string_view>
#include <vector>

namespace {

using namespace fsdpp;

// eval --logits writes its file whole: what is there already may only be an earlier dump.
void check_logits_target(const std::string& path) {
  if (std::filesystem::is_directory(path)) {
    throw UserError("eval --logits " + path + ": is a directory; name the file to write");
  }
  if (!std::filesystem::exists(path)) return;
  bool earlier_dump = false;
  try {
    const auto file = SafetensorsFile::open(path);
    earlier_dump = file->contains("input_ids") && file->contains("logits");
  } catch (const UserError&) {  // not safetensors: not a dump
  }
  if (!earlier_dump) {
    throw UserError("eval --logits " + path + ": exists and holds no earlier dump of logits, which it would "
                    "overwrite; choose another file");
  }
}

// train and eval compute a language model's loss over next tokens; a sequence-classification
// model's (a reward model's, a critic's) is its loop's, which brings its own loss in Python.
void require_language_model(const ModelSourceConfig& source, const char* command) {
  const ModelConfig model = model_config_of(source);
  if (model.num_labels > 0) {
    throw UserError(std::string(command) + ": [model] is a " + architecture_of(model) + " (num_labels " +
                    std::to_string(model.num_labels) + "), whose loss " + command + " cannot know: train or "
                    "score it from Python (fsdpp.Run, docs/python.md), where the loop brings its loss");
  }
}

RunConfig load_run(const CommandLine& args) {
  RunConfig config = RunConfig::load(args.config, args.overrides);
  if (config.train.threads > 0) at::set_num_threads(static_cast<int>(config.train.threads));
  return config;
}

int run_train(const CommandLine& args) {
  const RunConfig config = load_run(args);
  config.check_paths();
  require_language_model(config.model, "train");
  config.require_data();
  config.check_eval_schedule();
  check_outputs(config);
  auto build_plan = [&config](CausalLM& model, int world, int rank) {
    return run_configured_policy(config.policy, model, world, rank, /*training=*/true);
  };
  TrainSummary s;
  try {
    s = train(config, build_plan);
  } catch (const CorruptCheckpoint& e) {
    // A restart loop's resume = "latest" takes the newest checkpoint whatever became of it.
    if (config.checkpoint.resume.kind != ResumeFrom::Kind::latest) throw;
    throw UserError(std::string(e.what()) + "; [checkpoint] resume = \"latest\" took " + e.dir().string() +
                    " as this run's newest checkpoint: move it away to resume from the one before it");
  }
  if (s.stop_signal != 0) return 128 + s.stop_signal;  // as if the signal had ended it, after the save
  if (DistEnv::from_environment().rank == 0) log_info("done: ", s.steps, " steps, final loss ", s.final_loss,
           s.skipped_steps ? concat(", ", s.skipped_steps, " skipped") : std::string());
  return 0;
}

int run_plan(const CommandLine& args) {
  RunConfig config = load_run(args);
  // A plan reads no data or checkpoint, and of a [model] adapter its config alone.
  config.data.train.clear();
  config.checkpoint.resume = {};
  config.check_paths();
  const PolicyConfig& policy = config.policy;
  const ModelConfig model_config = model_config_of(config.model);
  config.check_experts(model_config);
  const at::ScalarType dtype = config.model.dtype;
  auto model = build_model(model_config, torch::TensorOptions().dtype(dtype).device(torch::kMeta));
  const auto script = find_policy(policy, model_config.model_type);
  const auto start = std::chrono::steady_clock::now();
  Plan plan =
      run_policy(script, *model, {.world_size = args.world, .rank = 0, .training = true, .options = policy.options});
  plan.lora = adapters_to_put_on(config.model, plan.lora ? &*plan.lora : nullptr);
  if (plan.lora) apply_lora(*model, *plan.lora, torch::TensorOptions().dtype(dtype).device(torch::kMeta));
  freeze_modules(plan, *model);
  const ResolvedPlan resolved = resolve_policy_plan(plan, *model, args.world, dtype, policy);
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  log_info("plan: policy ", script.string(), " over ", named_modules(*model).size(), " modules evaluated and validated in ",
           ms, " ms");
  if (args.json) {
    std::cout << plan_json(resolved, args.world) << std::endl;
  } else {
    // Under the working directory by its path from there (the shipped ones: policies/llama.lua),
    // elsewhere as found.
    const std::filesystem::path from_here = std::filesystem::relative(script);
    const bool under = !from_here.empty() && *from_here.begin() != "..";
    std::cout << "policy " << (under ? from_here : script).string() << "\n" << format_plan(resolved, args.world);
  }
  return 0;
}

int run_export(const CommandLine& args) {
  // Every process of a launch (RANK and WORLD_SIZE) or of an srun step would write the same
  // directory; a batch script's allocation alone runs its export as one process.
  const char* world = std::getenv("RANK") != nullptr ? std::getenv("WORLD_SIZE") : nullptr;
  const char* step_tasks = std::getenv("SLURM_STEP_NUM_TASKS");
  for (const auto& [name, count] : {std::pair{"WORLD_SIZE", world}, {"SLURM_STEP_NUM_TASKS", step_tasks}}) {
    if (count != nullptr && *count != '\0' && std::strcmp(count, "1") != 0) {
      throw UserError(std::string("export: runs as one process, and this is one of a launch's (") + name + " " +
                      count + "); run fsdpp export without a launcher");
    }
  }
  const auto start = std::chrono::steady_clock::now();
  const ExportSummary s =
      args.adapter_only
          ? export_adapter(args.checkpoint, args.out, args.dtype)
          : export_checkpoint(args.checkpoint, args.out, args.dtype, static_cast<size_t>(args.max_shard_mb * (1 << 20)),
                              args.merge_lora);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  log_info("export: step ", s.step, ", ", s.tensors, " tensors, ", s.bytes, " bytes written to ", args.out, " in ",
           seconds, " s");
  return 0;
}

// Evaluation is one process on the CPU: a GPU the run file asks for is checked as training
// checks it (a run file's settings mean one thing; device = "auto" asks for none here), and a
// launched eval is refused, since each rank would score everything again and print its own
// figures (and --logits would write one file from every rank).
void check_eval_alone(const RunConfig& config) {
  const DistEnv env = DistEnv::from_environment();
  if (!config.parallel.gpu_asked_by.empty()) {
    resolve_device(config.parallel.device, env.local_rank, env.local_world_size, config.parallel.gpu_asked_by);
  }
  if (env.world_size > 1) {
    throw UserError("eval: runs as one process (it shards nothing), but this process is rank " + std::to_string(env.rank) +
                    " of " + std::to_string(env.world_size) + ": run fsdpp eval without fsdpp launch or torchrun");
  }
}

// --logits: the inputs and logits of the first windows evaluated (at most max_windows, at
// least one), for a comparison with another implementation.
void write_eval_logits(const CommandLine& args, const DataConfig& data, int64_t evaluated, CausalLM& model) {
  const TokenFile tokens = TokenFile::open(data.train);
  const TokenRange range = eval_range(data, tokens);
  const int64_t windows = std::min<int64_t>(std::max<int64_t>(args.max_windows, 1), evaluated);
  std::vector<at::Tensor> inputs;
  for (int64_t w = 0; w < windows; ++w) inputs.push_back(tokens.slice(range.begin + w * data.seq_len, data.seq_len));
  const at::Tensor input_ids = at::stack(inputs);  // [N, T]
  at::NoGradGuard no_grad;
  model.eval();
  const at::Tensor logits = model(input_ids).to(at::kFloat);  // [N, T, V]
  write_safetensors(args.logits, {{"input_ids", input_ids}, {"logits", logits}});
}

int run_eval(const CommandLine& args) {
  RunConfig config = load_run(args);
  DataConfig data = config.data;
  if (args.tokens.empty()) config.require_data();
  if (!args.tokens.empty()) {
    data.train = args.tokens;
    data.eval_fraction = 0;  // all of FILE
    config.data.train.clear();  // not read: FILE is, and names itself where it is missing
  }
  config.checkpoint.resume = {};  // evaluation resumes nothing
  config.check_eval_seq_len();
  config.check_paths();
  require_language_model(config.model, "eval");
  if (!args.logits.empty()) check_logits_target(args.logits);
  check_eval_alone(config);
  // The policy puts on the adapters training would (a [model] adapter must agree with them),
  // and its [policy.options] are checked as there; evaluation does not shard.
  const auto skeleton =
      build_model(model_config_of(config.model), torch::TensorOptions().dtype(config.model.dtype).device(torch::kMeta));
  const Plan plan = run_configured_policy(config.policy, *skeleton, /*world=*/1, /*rank=*/0, /*training=*/false);
  auto loaded = load_model(config.model, /*unallocated=*/false, plan.lora ? &*plan.lora : nullptr);
  auto& model = loaded.model;
  const auto batches = open_batches(data, model->config(), BatchUse::evaluate);
  // The windows --logits writes are those a stream is scored in; documents are scored in
  // packed rows, and samples with their images.
  if (!args.logits.empty() && dynamic_cast<const TokenWindows*>(batches.get()) == nullptr) {
    throw UserError("eval --logits " + args.logits + ": writes windows of a token stream, but " + data.train +
                    " is evaluated in " + batches->item_name() + " (a file of documents or samples); evaluate it " +
                    "without --logits");
  }
  const EvalResult r = batches->evaluate(*model, args.max_windows, nullptr);
  if (!args.logits.empty()) write_eval_logits(args, data, r.windows, *model);
  if (args.json) {
    std::cout << nlohmann::json{{"windows", r.windows}, {"tokens", r.tokens}, {"loss", r.loss},
                                {"perplexity", r.perplexity}}.dump() << std::endl;
  } else {
    std::printf("eval: %lld %s of %lld tokens, %lld predicted: loss %.6f  perplexity %.4f\n",
                static_cast<long long>(r.windows), batches->item_name(), static_cast<long long>(config.data.seq_len),
                static_cast<long long>(r.tokens), r.loss, r.perplexity);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const CommandLine args = parse_command_line(argc, argv);
    if (!args.help.empty()) {
      std::cout << args.help;
      return 0;
    }
    switch (args.command) {
      case Command::probe:
        if (const auto cap = needed_onednn_cap()) std::cout << kOnednnIsaVariable << "=" << *cap << "\n";
        return 0;
      case Command::export_checkpoint:
        return run_export(args);
      case Command::plan:
        set_log_verbose(args.verbose);
        return run_plan(args);
      default:
        break;
    }
    // Before any kernel runs: the commands that compute settle which CPU kernels they may use.
    settle_cpu_kernels(argv);
    if (args.command == Command::launch) {
      return launch(args.launch, std::filesystem::read_symlink("/proc/self/exe").string());
    }
    set_log_verbose(args.verbose);
    return args.command == Command::train ? run_train(args) : run_eval(args);
  } catch (const UserError& e) {
    std::fprintf(stderr, "fsdpp: error: %s\n", e.what());
    return 2;
  } catch (const std::filesystem::filesystem_error& e) {
    // The machine refused a file operation (permissions, a full disk, a name too long): the
    // user's to fix, and the paths say where.
    std::fprintf(stderr, "fsdpp: error: %s\n", one_line(e.what()).c_str());
    return 2;
  } catch (const CollectiveFailure& e) {
    // Another rank's failure or stop, which the launcher reports as the cause: this rank's
    // exit is not a user error of its own.
    std::fprintf(stderr, "fsdpp: error: %s\n", e.what());
    return 1;
  } catch (const c10::OutOfMemoryError& e) {
    // The run asks for more device memory than there is: smaller batches, activation
    // checkpointing or offload are the user's levers.
    std::fprintf(stderr, "fsdpp: error: out of memory: %s\n", one_line(e.what_without_backtrace()).c_str());
    return 2;
  } catch (const c10::Error& e) {
    const std::string message = e.what_without_backtrace();
    if (const auto refused = host_allocation_refused(message)) {
      std::fprintf(stderr, "fsdpp: error: out of host memory: %s\n", one_line(*refused).c_str());
      return 2;
    }
    std::fprintf(stderr, "fsdpp: internal error: %s\n", one_line(message).c_str());
    return 1;
  } catch (const std::bad_alloc&) {
    std::fprintf(stderr, "fsdpp: error: out of host memory\n");
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fsdpp: internal error: %s\n", one_line(e.what()).c_str());
    return 1;
  }
}
