// Parsing the command line with CLI11. The help texts are written out by hand: they are
// the commands' documentation, and CLI11's own help and error wording is switched off so
// that every message reads like the engine's others.
#include "cli/arguments.h"

#include "core/dtype.h"
#include "core/error.h"

#include <CLI/CLI.hpp>

#include <algorithm>
#include <charconv>
#include <deque>
#include <functional>
#include <thread>

namespace fsdpp {

namespace {

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

Trains the model described by CONFIG (sections [model] [data] [optimizer] [loss_scale]
[scheduler] [train] [checkpoint] [metrics] [experts] [parallel] [policy]; see
examples/tiny-llama.toml and README.md). Each --set overrides one key,
its value read as TOML (a bare word is taken as a string). --verbose adds debug lines, such
as the Lua traceback of a policy error.
)";

constexpr const char* kEvalHelp = R"(usage: fsdpp eval CONFIG [--tokens FILE] [--max-windows N] [--json]
                  [--logits FILE] [--set section.key=value ...] [--verbose]

Mean next-token loss and perplexity of the model [model] names (fresh, trained or loaded
from an HF directory) over FILE when given, else over data.train's held-out part (all of it
when eval_fraction is 0). A token file with document ends is evaluated by its documents, in
rows laid out as training lays them out ([data] packing, train_on; --max-windows counts
rows); any other over consecutive non-overlapping windows of data.seq_len tokens, each
predicting its tokens 2..seq_len, as transformers does with labels = input_ids (a file of
exactly seq_len tokens is one window; training's windows hold seq_len + 1).
--max-windows 0 (the default) evaluates all of them. [model] path may name a sharded
checkpoint; the [policy]'s LoRA adapters are put on as training puts them. --logits FILE
also writes the first windows of a token stream (--max-windows of them, at least 1) and
their logits to FILE as safetensors (input_ids [N, T] int64, logits [N, T, V] float32), for
comparison with another implementation. Evaluation runs as one process, never under fsdpp
launch or torchrun. --verbose adds debug lines.
)";

constexpr const char* kExportHelp = R"(usage: fsdpp export CHECKPOINT OUT [--dtype D] [--max-shard-mb N] [--merge-lora | --adapter]

Writes the model of the sharded checkpoint CHECKPOINT (a step-N directory that training
saved) to OUT as a Hugging Face directory: config.json plus model.safetensors, or shards
of at most N MiB (default 2048, fractions allowed) with model.safetensors.index.json. D is
float32, bfloat16, float16 or float64, or bf16, fp16 and the like (default: the dtype the run
trained in). Runs as one process on one machine, without a launcher or a process
group and holds one full tensor at a time; every file's checksum is verified first.
A LoRA run's checkpoint exports with --merge-lora: each adapted weight W becomes
W + (alpha / r) B A and the adapters are left out; or with --adapter: its adapters (and the
base modules that train beside them) alone, as a PEFT adapter directory
(adapter_config.json, adapter_model.safetensors) for the base the run trained on.
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

constexpr const char* kLaunchHelp = R"(usage: fsdpp launch --nproc-per-node N [--nnodes M --node-rank R --master-addr A]
                    [--master-port P] -- COMMAND [ARGS...]

Starts N ranks of this node, each running `fsdpp COMMAND ARGS...` with RANK, WORLD_SIZE,
LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT set (as torchrun sets them).
Every line a rank prints is prefixed with its rank. SIGINT and SIGTERM pass to every rank
(training saves a checkpoint and stops) and launch exits 128 + the signal; one sent to a
single rank stops them all the same way, with that signal's status. A launcher killed
outright leaves each rank a SIGTERM. When one rank fails the others are stopped (SIGTERM,
then SIGKILL after 5 s) and launch exits 2 with one line naming the rank that failed and
why, or the rank that stopped answering while the others waited for it. On
one node the port defaults to a free one; across nodes to 29500, with A the address of
node 0.
)";

// A whole number for `flag` in [min, max], or UserError in the command's words.
int64_t whole_number(const std::string& command, const std::string& flag, const std::string& text, int64_t min,
                     int64_t max) {
  // The digits alone: no space or sign around them, as a shell's word gives a number.
  int64_t v = 0;
  const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (error == std::errc() && end == text.data() + text.size() && v >= min && v <= max) return v;
  throw UserError(command + ": " + flag + " takes a whole number in [" + std::to_string(min) + ", " +
                  std::to_string(max) + "], got '" + text + "'");
}

// Ranks one node may start: a few per core, as oversubscribed CPU tests run, and no more.
int max_local_ranks() { return 4 * static_cast<int>(std::max(1u, std::thread::hardware_concurrency())); }

// One command's options: CLI11 matches them (--opt value, --opt=value, flags, positionals);
// what it cannot place is reported here, as the engine words it. Each option takes one value,
// given once and not empty; whole numbers are read from their text once parsing is done.
class OptionParser {
 public:
  explicit OptionParser(std::string command) : command_(std::move(command)) {
    app_.set_help_flag();
    app_.allow_extras();
    app_.add_flag("-h,--help", help_);
  }

  CLI::App& app() { return app_; }

  // Parses `args`; true when --help was asked for.
  bool parse(std::vector<std::string> args) {
    refuse_repeats_and_gaps(args);
    std::reverse(args.begin(), args.end());  // CLI11 takes the arguments last first
    try {
      app_.parse(args);
    } catch (const CLI::ArgumentMismatch& e) {  // "--set: 1 required TEXT missing"
      const std::string what = e.what();
      throw UserError(command_ + ": " + what.substr(0, what.find(':')) + " needs a value");
    } catch (const CLI::ParseError& e) {
      throw UserError(command_ + ": " + e.what() + " (see fsdpp " + command_ + " --help)");
    }
    if (help_) return true;
    for (const std::string& extra : app_.remaining()) {
      if (extra.starts_with("-")) {
        throw UserError(command_ + ": unknown option " + extra + " (see fsdpp " + command_ + " --help)");
      }
      throw UserError(command_ + ": unexpected argument '" + extra + "'");
    }
    for (const auto& [name, value] : texts_) {  // "" would read as the option left out
      if (given(name) && value->empty()) throw UserError(command_ + ": " + name + " needs a value, got ''");
    }
    for (const auto& read : numbers_) read();
    return false;
  }

  // A string option (or, named without "--", a positional one).
  void add(const std::string& name, std::string& value) {
    app_.add_option(name, value);
    if (name.starts_with("--")) texts_.emplace_back(name, &value);
  }

  // A whole number in [min, max], refused in the command's words (whole_number) as given,
  // empty or spaced text included.
  template <typename Int>
  void add_number(const std::string& name, Int& value, int64_t min, int64_t max) {
    std::string& text = number_texts_.emplace_back();
    app_.add_option(name, text);
    numbers_.push_back([this, name, &text, &value, min, max] {
      if (given(name)) value = static_cast<Int>(whole_number(command_, name, text, min, max));
    });
  }

  bool given(const std::string& name) const { return app_.get_option(name)->count() > 0; }

 private:
  // CLI11 reads an option given twice as one missing its value, and `--opt= 3` as `--opt 3`:
  // both are refused before it sees them, naming the option. A flag said twice is said once.
  void refuse_repeats_and_gaps(const std::vector<std::string>& args) const {
    for (const CLI::Option* option : app_.get_options()) {
      const std::string name = option->get_name();
      if (!name.starts_with("--") || name == "--set" || option->get_expected_max() == 0) continue;  // flags
      int uses = 0;
      for (const std::string& arg : args) {
        if (arg == name + "=") {
          throw UserError(command_ + ": " + name + "= has no value after '='; write " + name + "=VALUE or " + name +
                          " VALUE");
        }
        uses += arg == name || arg.starts_with(name + "=");
      }
      if (uses > 1) {
        throw UserError(command_ + ": " + name + " given " + (uses == 2 ? "twice" : std::to_string(uses) + " times"));
      }
    }
  }

  std::string command_;
  CLI::App app_;
  bool help_ = false;
  std::vector<std::pair<std::string, const std::string*>> texts_;
  std::deque<std::string> number_texts_;  // a deque: CLI11 holds references into it
  std::vector<std::function<void()>> numbers_;
};

// train, eval and plan: CONFIG, --set (any number) and --verbose, with each one's own options.
void parse_run_command(const std::string& command, const std::vector<std::string>& args, CommandLine& cl) {
  OptionParser parser(command);
  auto& app = parser.app();
  parser.add("CONFIG", cl.config);
  app.add_option("--set", cl.overrides)->allow_extra_args(false);
  app.add_flag("--verbose", cl.verbose);
  if (command == "eval") {
    parser.add("--tokens", cl.tokens);
    parser.add("--logits", cl.logits);
    parser.add_number("--max-windows", cl.max_windows, 0, int64_t{1} << 40);
  }
  if (command == "plan") parser.add_number("--world", cl.world, 1, 1 << 20);
  if (command == "eval" || command == "plan") app.add_flag("--json", cl.json);
  if (parser.parse(args)) {
    cl.help = command == "train" ? kTrainHelp : command == "eval" ? kEvalHelp : kPlanHelp;
    return;
  }
  if (cl.config.empty()) throw UserError(command + ": missing CONFIG (see fsdpp " + command + " --help)");
}

void parse_export(const std::vector<std::string>& args, CommandLine& cl) {
  OptionParser parser("export");
  std::string max_shard_mb, dtype;
  parser.add("CHECKPOINT", cl.checkpoint);
  parser.add("OUT", cl.out);
  parser.add("--dtype", dtype);
  parser.add("--max-shard-mb", max_shard_mb);
  parser.app().add_flag("--merge-lora", cl.merge_lora);
  parser.app().add_flag("--adapter", cl.adapter_only);
  if (parser.parse(args)) {
    cl.help = kExportHelp;
    return;
  }
  if (cl.checkpoint.empty() || cl.out.empty()) {
    throw UserError("export: needs CHECKPOINT and OUT, neither empty (see fsdpp export --help)");
  }
  if (cl.merge_lora && cl.adapter_only) {
    throw UserError("export: --merge-lora writes the merged model and --adapter the adapters alone; give one");
  }
  try {
    if (!dtype.empty()) cl.dtype = parse_dtype(dtype);
  } catch (const UserError& e) {
    throw UserError(std::string("export --dtype: ") + e.what());
  }
  if (!max_shard_mb.empty()) {
    try {
      size_t used = 0;
      cl.max_shard_mb = std::stod(max_shard_mb, &used);
      if (used != max_shard_mb.size()) cl.max_shard_mb = 0;
    } catch (const std::exception&) {
      cl.max_shard_mb = 0;
    }
    if (!(cl.max_shard_mb > 0 && cl.max_shard_mb <= 1e9)) {
      throw UserError("export: --max-shard-mb takes a number in (0, 1e9], got '" + max_shard_mb + "'");
    }
  }
}

// launch's own options come before "--"; everything after it is the command each rank runs.
// The ranks' command line, parsed here as each rank would: a mistake in it is then one line
// before any rank starts, not one per rank.
void check_rank_command(const std::vector<std::string>& command) {
  if (command.front() == "launch") {
    throw UserError("launch: the ranks' command is a launch itself; give the command without a second launch");
  }
  std::vector<std::string> words{"fsdpp"};
  words.insert(words.end(), command.begin(), command.end());
  std::vector<char*> argv;
  for (auto& word : words) argv.push_back(word.data());
  try {
    parse_command_line(static_cast<int>(argv.size()), argv.data());
  } catch (const UserError& e) {
    const bool foreign = std::string(e.what()).starts_with("unknown command");
    throw UserError(std::string("launch: ") + e.what() +
                    (foreign ? "; a launch's ranks run fsdpp's own commands (torchrun starts other programs' ranks)"
                             : ""));
  }
}

void parse_launch(const std::vector<std::string>& args, CommandLine& cl) {
  const auto separator = std::find(args.begin(), args.end(), "--");
  if (separator == args.end()) {  // the ranks' command would read as launch's own arguments
    const auto command = std::find_if(args.begin(), args.end(), [](const std::string& a) {
      return a == "train" || a == "eval" || a == "plan" || a == "export";
    });
    if (command != args.end()) {
      throw UserError("launch: put '--' before the command each rank runs: fsdpp launch ... -- " + *command + " ...");
    }
  }
  OptionParser parser("launch");
  LaunchOptions& o = cl.launch;
  std::string master_addr;
  parser.add_number("--nproc-per-node", o.nproc_per_node, 1, max_local_ranks());
  parser.add_number("--nnodes", o.nnodes, 1, 1 << 16);
  parser.add_number("--node-rank", o.node_rank, 0, (1 << 16) - 1);
  parser.add("--master-addr", master_addr);
  parser.add_number("--master-port", o.master_port, 1, 65535);
  if (parser.parse({args.begin(), separator})) {
    cl.help = kLaunchHelp;
    return;
  }
  if (separator != args.end()) o.command.assign(separator + 1, args.end());
  if (o.command.empty()) throw UserError("launch: missing '-- COMMAND', e.g. -- train run.toml");
  check_rank_command(o.command);
  // Required, as the usage says: a default of one would train as one rank, unasked.
  if (!parser.given("--nproc-per-node")) {
    throw UserError("launch: --nproc-per-node N is required (the ranks to start on this node)");
  }
  if (o.node_rank >= o.nnodes) {
    throw UserError("launch: --node-rank " + std::to_string(o.node_rank) + " must be below --nnodes " +
                    std::to_string(o.nnodes));
  }
  // Across nodes every rank meets node 0's store: a node that guessed its place or the
  // address would wait out the whole timeout before failing.
  if (o.nnodes > 1 && (!parser.given("--node-rank") || master_addr.empty())) {
    throw UserError("launch: --nnodes " + std::to_string(o.nnodes) + " needs --node-rank (this node's place, 0 to " +
                    std::to_string(o.nnodes - 1) + ") and --master-addr (node 0's address) on every node");
  }
  if (!master_addr.empty()) o.master_addr = master_addr;
  if (!parser.given("--master-port")) o.master_port = o.nnodes == 1 ? 0 : 29500;
}

}  // namespace

CommandLine parse_command_line(int argc, char** argv) {
  CommandLine cl;
  const std::string command = argc > 1 ? argv[1] : "";
  const std::vector<std::string> args(argv + std::min(argc, 2), argv + argc);
  if (command.empty()) throw UserError("no command given (fsdpp --help lists them)");
  if (command == "--help" || command == "-h" || command == "help") {
    cl.help = kUsage;
  } else if (command == "train" || command == "eval" || command == "plan") {
    cl.command = command == "train" ? Command::train : command == "eval" ? Command::eval : Command::plan;
    parse_run_command(command, args, cl);
  } else if (command == "export") {
    cl.command = Command::export_checkpoint;
    parse_export(args, cl);
  } else if (command == "launch") {
    cl.command = Command::launch;
    parse_launch(args, cl);
  } else if (command == "probe") {
    cl.command = Command::probe;
    if (OptionParser("probe").parse(args)) cl.help = kUsage;
  } else {
    throw UserError("unknown command '" + command +
                    "' (commands: train, eval, plan, launch, export, probe; see fsdpp --help)");
  }
  return cl;
}

}  // namespace fsdpp
