// The fsdpp command line: `train` and `eval` over a TOML run file. Every user error is one
// line on stderr and exit status 2; an engine fault is one line and status 1.
#include "bindings/lua/policy.h"
#include "core/cpu_kernels.h"
#include "core/error.h"
#include "core/log.h"
#include "core/module_tree.h"
#include "distributed/dist_env.h"
#include "distributed/launcher.h"
#include "models/registry.h"
#include "io/checkpoint_export.h"
#include "io/hf_dir.h"
#include "train/model_source.h"
#include "train/batches.h"
#include "train/data.h"
#include "train/evaluate.h"
#include "train/trainer.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <optional>
#include <iostream>
#include <string>
#include <vector>

namespace {

using namespace fsdpp;

constexpr const char* kUsage = R"(usage: fsdpp <command> [options]

commands:
  train CONFIG   train the model a TOML run file describes
  eval CONFIG    mean next-token loss and perplexity of the configured model
  plan CONFIG    the wrap plan the policy makes, and per-rank memory, for N ranks
  launch ... -- COMMAND
                 run COMMAND (e.g. train CONFIG) as several ranks of one job
  export CHECKPOINT OUT
                 write a sharded checkpoint's model as a Hugging Face directory
  probe          the oneDNN cap this CPU needs for bf16 products, as VAR=VALUE (nothing
                 when it needs none), for other programs sharing the machine's kernels

`fsdpp <command> --help` describes a command's options.
)";

constexpr const char* kTrainHelp = R"(usage: fsdpp train CONFIG [--set section.key=value ...] [--verbose]

Trains the model described by CONFIG (sections [model] [data] [optimizer] [scheduler]
[train] [checkpoint] [metrics]; see examples/tiny-llama.toml). Each --set overrides one key,
its value read as TOML (a bare word is taken as a string). --verbose adds debug lines, such
as the Lua traceback of a policy error.
)";

constexpr const char* kEvalHelp = R"(usage: fsdpp eval CONFIG [--tokens FILE] [--max-windows N] [--json]
                  [--logits FILE] [--set section.key=value ...]

Mean next-token loss and perplexity of the model [model] names (fresh, trained or loaded
from an HF directory) over FILE when given, else over data.train's held-out part (all of it
when eval_fraction is 0). A token file with document ends is evaluated by its documents, in
rows laid out as training lays them out ([data] packing, train_on; --max-windows counts
rows); any other over consecutive non-overlapping windows of data.seq_len tokens, each
predicting its tokens 2..seq_len, as transformers does with labels = input_ids.
[model] path may name a sharded checkpoint. --logits FILE also writes the first windows
(--max-windows of them, default 1) and their logits to FILE as safetensors (input_ids
[N, T] int64, logits [N, T, V] float32), for comparison with another implementation.
)";

constexpr const char* kExportHelp = R"(usage: fsdpp export CHECKPOINT OUT [--dtype D] [--max-shard-mb N]

Writes the model of the sharded checkpoint CHECKPOINT (a step-N directory that training
saved) to OUT as a Hugging Face directory: config.json plus model.safetensors, or shards
of at most N MiB (default 2048, fractions allowed) with model.safetensors.index.json. D is float32, bfloat16
or float16 (default: the dtype the run trained in). Runs on one machine without a process
group and holds one full tensor at a time; every file's checksum is verified first.
)";

constexpr const char* kPlanHelp = R"(usage: fsdpp plan CONFIG [--world N] [--json] [--set section.key=value ...]
                  [--verbose]

Builds the model of CONFIG on the meta device (no memory), runs its wrap policy ([policy]
name, default the model_type's own, with [policy.options]) for a simulated world of N ranks
(default 1), validates the plan and prints the unit tree: modules, parameters and options
per unit, the mesh, and per-rank memory (sharded parameters, gradients, optimizer state,
the largest gathered unit). No process group, no GPU. --verbose adds a policy error's Lua
traceback.
)";

constexpr const char* kLaunchHelp = R"(usage: fsdpp launch --nproc-per-node N [--nnodes M --node-rank R]
                    [--master-addr A] [--master-port P] -- COMMAND [ARGS...]

Starts N ranks of this node, each running `fsdpp COMMAND ARGS...` with RANK, WORLD_SIZE,
LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT set (as torchrun sets them).
Every line a rank prints is prefixed with its rank. SIGINT and SIGTERM pass to every rank.
When one rank fails the others are stopped (SIGTERM, then SIGKILL after 5 s) and launch
exits non-zero naming the rank and its exit status. On one node the port defaults to a
free one; across nodes to 29500, with A the address of node 0.
)";

struct Args {
  std::string config;
  std::vector<std::string> overrides;
  std::string tokens;
  std::string logits;
  int64_t max_windows = 0;
  int world = 1;
  bool json = false;
  bool help = false;
  bool verbose = false;
};

Args parse_args(const std::string& command, int argc, char** argv) {
  Args args;
  auto value = [&](int& i, const std::string& flag) -> std::string {
    if (i + 1 >= argc) throw UserError(command + ": " + flag + " needs a value");
    return argv[++i];
  };
  for (int i = 2; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--help" || a == "-h") {
      args.help = true;
    } else if (a == "--verbose") {
      args.verbose = true;
    } else if (a == "--set") {
      args.overrides.push_back(value(i, a));
    } else if (a.starts_with("--set=")) {
      args.overrides.push_back(a.substr(6));
    } else if (command == "eval" && a == "--tokens") {
      args.tokens = value(i, a);
    } else if (command == "eval" && a == "--logits") {
      args.logits = value(i, a);
    } else if (command == "eval" && a == "--max-windows") {
      const std::string v = value(i, a);
      try {
        args.max_windows = std::stoll(v);
      } catch (const std::exception&) {
        throw UserError("eval: --max-windows takes a number, got '" + v + "'");
      }
    } else if ((command == "eval" || command == "plan") && a == "--json") {
      args.json = true;
    } else if (command == "plan" && a == "--world") {
      const std::string v = value(i, a);
      try {
        args.world = std::stoi(v);
      } catch (const std::exception&) {
        args.world = 0;
      }
      if (args.world < 1) throw UserError("plan: --world takes a number >= 1, got '" + v + "'");
    } else if (a.starts_with("-")) {
      throw UserError(command + ": unknown option " + a + " (see fsdpp " + command + " --help)");
    } else if (args.config.empty()) {
      args.config = a;
    } else {
      throw UserError(command + ": unexpected argument '" + a + "'");
    }
  }
  if (!args.help && args.config.empty()) throw UserError(command + ": missing CONFIG (see fsdpp " + command + " --help)");
  return args;
}

RunConfig load_run(const Args& args) {
  RunConfig config = RunConfig::load(args.config, args.overrides);
  if (config.train.threads > 0) at::set_num_threads(static_cast<int>(config.train.threads));
  return config;
}

PolicyConfig policy_config(const RunConfig& config) {
  auto section = config.source.section("policy");
  return PolicyConfig::from_section(section);
}

int run_train(const Args& args) {
  const RunConfig config = load_run(args);
  const PolicyConfig policy = policy_config(config);
  auto build_plan = [&policy](CausalLM& model, int world, int rank) {
    return run_policy(find_policy(policy, model.config().model_type), model,
                      {.world_size = world, .rank = rank, .training = true, .options = policy.options});
  };
  const TrainSummary s = train(config, build_plan);
  if (s.stop_signal != 0) return 128 + s.stop_signal;  // as if the signal had ended it, after the save
  if (DistEnv::from_environment().rank == 0) log_info("done: ", s.steps, " steps, final loss ", s.final_loss,
           s.skipped_steps ? concat(", ", s.skipped_steps, " skipped") : std::string());
  return 0;
}

int run_plan(const Args& args) {
  const RunConfig config = load_run(args);
  const PolicyConfig policy = policy_config(config);
  const ModelConfig model_config = ModelConfig::from_file(hf_config_path(config.model.path));
  const auto dtype = parse_dtype(config.model.dtype);
  auto model = build_model(model_config, torch::TensorOptions().dtype(dtype).device(torch::kMeta));
  const auto script = find_policy(policy, model_config.model_type);
  const auto start = std::chrono::steady_clock::now();
  Plan plan = run_policy(script, *model, {.world_size = args.world, .rank = 0, .training = true, .options = policy.options});
  const ResolvedPlan resolved = resolve_plan(plan, *model, args.world, dtype);
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  log_info("plan: policy ", script.string(), " over ", named_modules(*model).size(), " modules evaluated and validated in ",
           ms, " ms");
  if (args.json) {
    std::cout << plan_json(resolved, args.world) << std::endl;
  } else {
    std::cout << "policy " << std::filesystem::relative(script).string() << "\n" << format_plan(resolved, args.world);
  }
  return 0;
}

int run_export(const std::vector<std::string>& argv) {
  std::vector<std::string> positional;
  std::optional<at::ScalarType> dtype;
  double max_shard_mb = 2048;
  for (size_t i = 0; i < argv.size(); ++i) {
    const std::string& a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argv.size()) throw UserError("export: " + a + " needs a value");
      return argv[++i];
    };
    if (a == "--dtype") {
      dtype = parse_dtype(value());
    } else if (a == "--max-shard-mb") {
      const std::string v = value();
      try {
        max_shard_mb = std::stod(v);
      } catch (const std::exception&) {
        max_shard_mb = 0;
      }
      if (!(max_shard_mb > 0 && max_shard_mb <= 1e9)) {
        throw UserError("export: --max-shard-mb takes a number in (0, 1e9], got '" + v + "'");
      }
    } else if (a.starts_with("-")) {
      throw UserError("export: unknown option " + a + " (see fsdpp export --help)");
    } else {
      positional.push_back(a);
    }
  }
  if (positional.size() != 2) throw UserError("export: needs CHECKPOINT and OUT (see fsdpp export --help)");
  const auto start = std::chrono::steady_clock::now();
  const ExportSummary s = export_checkpoint(positional[0], positional[1], dtype, static_cast<size_t>(max_shard_mb * (1 << 20)));
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  log_info("export: step ", s.step, ", ", s.tensors, " tensors, ", s.bytes, " bytes written to ", positional[1], " in ",
           seconds, " s");
  return 0;
}

int run_eval(const Args& args) {
  const RunConfig config = load_run(args);
  policy_config(config);  // validates [policy] even though evaluation does not shard
  DataConfig data = config.data;
  if (!args.tokens.empty()) {
    data.train = args.tokens;
    data.eval_fraction = 0;  // all of FILE
  }
  auto loaded = load_model(config.model);
  auto& model = loaded.model;
  const auto batches = open_batches(data, model->config());
  const EvalResult r = batches->evaluate(*model, args.max_windows, nullptr);
  if (!args.logits.empty()) {
    const TokenFile tokens = TokenFile::open(data.train);
    const TokenRange range = eval_range(data, tokens);
    const int64_t windows = std::min<int64_t>(std::max<int64_t>(args.max_windows, 1), r.windows);
    std::vector<at::Tensor> inputs;
    for (int64_t w = 0; w < windows; ++w) inputs.push_back(tokens.slice(range.begin + w * config.data.seq_len, config.data.seq_len));
    const at::Tensor input_ids = at::stack(inputs);  // [N, T]
    at::NoGradGuard no_grad;
    model->eval();
    const at::Tensor logits = (*model)(input_ids).to(at::kFloat);  // [N, T, V]
    write_safetensors(args.logits, {{"input_ids", input_ids}, {"logits", logits}});
  }
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
  const std::string command = argc > 1 ? argv[1] : "";
  try {
    if (command.empty()) {
      std::cerr << "fsdpp: error: no command given (fsdpp --help lists them)\n";
      return 2;
    }
    if (command == "--help" || command == "-h" || command == "help") {
      std::cout << kUsage;
      return 0;
    }
    if (command == "probe") {
      if (const auto cap = needed_onednn_cap()) std::cout << kOnednnIsaVariable << "=" << *cap << "\n";
      return 0;
    }
    // Before any kernel runs: the commands that compute settle which CPU kernels they may use.
    if (command == "train" || command == "eval" || command == "launch") settle_cpu_kernels(argv);
    if (command == "launch") {
      std::vector<std::string> rest(argv + 2, argv + argc);
      if (!rest.empty() && (rest[0] == "--help" || rest[0] == "-h")) {
        std::cout << kLaunchHelp;
        return 0;
      }
      const LaunchOptions options = parse_launch_args(rest);
      return launch(options, std::filesystem::read_symlink("/proc/self/exe").string());
    }
    if (command == "export") {
      std::vector<std::string> rest(argv + 2, argv + argc);
      if (!rest.empty() && (rest[0] == "--help" || rest[0] == "-h")) {
        std::cout << kExportHelp;
        return 0;
      }
      return run_export(rest);
    }
    if (command != "train" && command != "eval" && command != "plan") {
      throw UserError("unknown command '" + command +
                      "' (commands: train, eval, plan, launch, export, probe; see fsdpp --help)");
    }
    const Args args = parse_args(command, argc, argv);
    if (args.help) {
      std::cout << (command == "train" ? kTrainHelp : command == "eval" ? kEvalHelp : kPlanHelp);
      return 0;
    }
    set_log_verbose(args.verbose);
    if (command == "plan") return run_plan(args);
    return command == "train" ? run_train(args) : run_eval(args);
  } catch (const UserError& e) {
    std::fprintf(stderr, "fsdpp: error: %s\n", e.what());
    return 2;
  } catch (const std::filesystem::filesystem_error& e) {
    // The machine refused a file operation (permissions, a full disk, a name too long): the
    // user's to fix, and the paths say where.
    std::fprintf(stderr, "fsdpp: error: %s\n", one_line(e.what()).c_str());
    return 2;
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "fsdpp: internal error: %s\n", e.what_without_backtrace());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fsdpp: internal error: %s\n", e.what());
    return 1;
  }
}
