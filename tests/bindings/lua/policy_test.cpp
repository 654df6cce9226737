// The policy sandbox and API: every escape route fails with a clear error carrying the
// script's file:line and the engine keeps working; warnings and errors name what the model
// has; editing a script changes the plan with no rebuild.
#include "bindings/lua/policy.h"
#include "core/error.h"
#include "core/module_tree.h"
#include "fsdp/plan_text.h"
#include "models/lora.h"
#include "models/registry.h"
#include "scratch_dir.h"

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>

using namespace fsdpp;
namespace fs = std::filesystem;

namespace {

std::shared_ptr<CausalLM> meta_model(bool tied = false) {
  auto config = ModelConfig::from_json(
      {{"model_type", "llama"}, {"vocab_size", 50}, {"hidden_size", 24}, {"intermediate_size", 40},
       {"num_hidden_layers", 3}, {"num_attention_heads", 4}, {"num_key_value_heads", 2},
       {"tie_word_embeddings", tied}},
      "test");
  return build_model(config, torch::TensorOptions().device(torch::kMeta));
}

fs::path write_policy(const std::string& name, const std::string& text) {
  auto path = testing::scratch_dir("policy") / name;
  std::ofstream(path) << text;
  return path;
}

std::string policy_error(const std::string& text, const PolicyLimits& limits = {}) {
  auto model = meta_model();
  try {
    run_policy(write_policy("escape.lua", text), *model, {}, limits);
  } catch (const UserError& e) {
    return e.what();
  }
  return "";
}

// A script that must fail, and what its one-line error must say.
struct Escape {
  const char* name;
  std::string script;
  const char* expect;
};

}  // namespace

TEST_CASE("sandbox escapes fail with file:line", "[lua]") {
  const std::vector<Escape> escapes = {
      {"io.open", "local x = 1\nlocal f = io.open('/etc/passwd')\n", "escape.lua:2: undefined global 'io'"},
      {"os.execute", "os.execute('touch /tmp/pwned')\n", "escape.lua:1: attempt to call a nil value (field 'execute')"},
      {"string.dump", "local f = string.dump(function() end)\n", "escape.lua:1: attempt to call a nil value (field 'dump')"},
      {"bytecode load", "local ok, err = load('\\27Lua')\nassert(ok, err)\n", "attempt to load a binary chunk"},
      {"debug", "debug.sethook()\n", "escape.lua:1: undefined global 'debug'"},
      {"package", "package.loadlib('x', 'y')\n", "escape.lua:1: undefined global 'package'"},
      {"dofile", "dofile('/etc/passwd')\n", "escape.lua:1: undefined global 'dofile'"},
      {"require outside lib", "require('../../etc/passwd')\n", "escape.lua:1: require: '../../etc/passwd' is not a module of policies/lib"},
      {"require missing", "require('nope')\n", "escape.lua:1: require: no module 'nope'"},
      {"global write", "leak = 1\n", "escape.lua:1: assignment to undeclared global 'leak'"},
      // Globals and libraries are read-only views behind protected metatables.
      {"rawset on _G", "rawset(_G, 'leak', 1)\n", "escape.lua:1: undefined global 'rawset'"},
      {"setmetatable(_G, nil)", "setmetatable(_G, nil)\n", "escape.lua:1: cannot change a protected metatable"},
      {"string metatable", "getmetatable('').__index = {}\n", "escape.lua:1: attempt to index a string value"},
      {"overwrite a global", "pairs = nil\n", "escape.lua:1: assignment to global 'pairs': globals are read-only"},
      {"overwrite string.find", "string.find = nil\n", "escape.lua:1: string.find is read-only"},
      {"new field in math", "math.evil = 1\n", "escape.lua:1: math.evil is read-only"},
      {"table.insert", "table.insert = nil\n", "escape.lua:1: table.insert is read-only"},
      {"library metatable", "setmetatable(string, nil)\n", "escape.lua:1: cannot change a protected metatable"},
      {"module handle metatable", "getmetatable(ctx.model).__index = {}\n", "escape.lua:1: attempt to index a string value"},
      {"loaded chunk writes a global", "load('leak = 1')()\n", "(load):1: assignment to undeclared global 'leak'"},
      // pairs() over a view walks the real table without handing it out.
      {"pairs hands out the globals", "local _, G = pairs(_G)\nG.leak = 1\n", "escape.lua:2: attempt to index a nil value (local 'G')"},
      {"pairs hands out a library", "local _, S = pairs(string)\nS.evil = 1\n", "escape.lua:2: attempt to index a nil value (local 'S')"},
      // Finalizers would run where no budget reaches.
      {"__gc finalizer", "setmetatable({}, {__gc = function() while true do end end})\n",
       "escape.lua:1: setmetatable: __gc finalizers are not allowed in a policy"},
      {"collectgarbage", "collectgarbage('stop')\n", "escape.lua:1: undefined global 'collectgarbage'"},
      // Errors are one line with file:line, whatever was raised.
      {"error with a table", "\nerror({code = 1})\n", "escape.lua:2: error raised with a table value"},
      {"error with nil", "error()\n", "escape.lua:1: error raised with a nil value"},
      // A message without a position (a number, level 0) is given the line that raised it.
      {"error with a number", "\nerror(42)\n", "escape.lua:2: 42"},
      {"error at level 0", "local x = 1\nerror('no position', 0)\n", "escape.lua:2: no position"},
      {"bytecode as the policy", "\x1bLua", "escape.lua: attempt to load a binary chunk"},
      // Every line of a message, and of a long one what a line shows.
      {"error of two lines", "error('first\\nsecond')\n", "escape.lua:1: first\\nsecond"},
      {"error of a megabyte", "error(string.rep('x', 1 << 20))\n", "xxx... (104"},
      // The traceback copies the message into the heap: cut first, so it fits.
      {"error near the heap's cap", "error(string.rep('y', 15000000))\n", "yyy... (150000"},
  };
  for (const auto& e : escapes) {
    INFO(e.name);
    const std::string error = policy_error(e.script);
    CHECK_THAT(error, Catch::Contains(e.expect));
    CHECK(error.find('\n') == std::string::npos);  // one line; the traceback is for --verbose
    CHECK(error.size() < 4200);
  }
}

// The budget, the deadline and the memory cap stop what no pcall, C routine or finalizer may
// prolong; each within the deadline, and the engine keeps working.
TEST_CASE("runaway policies stop within their deadline and the engine survives", "[lua]") {
  const PolicyLimits quick{.instructions = 2'000'000, .memory_bytes = 8u << 20, .deadline = std::chrono::seconds(3)};
  const std::vector<Escape> runaways = {
      {"endless loop", "local n = 0\nwhile true do n = n + 1 end\n", "escape.lua:2: policy exceeded its instruction budget"},
      {"pcall swallowing the budget", "while true do\n  pcall(function() while true do end end)\nend\n",
       "policy exceeded its instruction budget"},
      // Lua runs a message handler for the budget's own error with hooks off: the sandbox's
      // xpcall runs none once the budget is spent.
      {"xpcall with a looping handler", "xpcall(function() while true do end end, function() while true do end end)\n",
       "escape.lua:1: policy exceeded its instruction budget"},
      {"backtracking pattern", "local s = string.rep('a', 40)\nstring.find(s, string.rep('a*', 40) .. 'b')\n",
       "still running after 3 s, its deadline"},
      {"memory", "local t = {}\nfor i = 1, 1e9 do t[i] = string.rep('x', 1000) .. i end\n",
       "policy exceeded its memory cap of 8 MiB"},
      {"one huge string", "local s = string.rep('x', 1 << 27)\n", "policy exceeded its memory cap of 8 MiB"},
      {"an impossible string", "local s = string.rep('x', 1 << 62)\n", "escape.lua:1: resulting string too large"},
      {"deep recursion", "local function f() return 1 + f() end\nf()\n", "policy exceeded its memory cap of 8 MiB"},
      {"__close that loops", "do local x <close> = setmetatable({}, {__close = function() while true do end end}) end\n",
       "policy exceeded its instruction budget"},
      {"gsub callback that loops", "string.gsub('abc', '.', function() while true do end end)\n",
       "policy exceeded its instruction budget"},
  };
  for (const auto& r : runaways) {
    INFO(r.name);
    const auto start = std::chrono::steady_clock::now();
    const std::string error = policy_error(r.script, quick);
    CHECK_THAT(error, Catch::Contains(r.expect));
    CHECK(error.find('\n') == std::string::npos);
    CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(6));
  }
  // The engine is unharmed: a valid policy still runs.
  auto model = meta_model();
  auto plan = run_policy(write_policy("ok.lua", "wrap(ctx.model:get('model.layers.0'))\n"), *model, {});
  CHECK(plan.units.size() == 1);
}

TEST_CASE("API errors and warnings name file:line and what the model has", "[lua]") {
  CHECK_THAT(policy_error("\n\nwrap(nil)\n"), Catch::Contains("escape.lua:3: wrap expects a module or a list of modules, got nil"));
  CHECK_THAT(policy_error("wrap(ctx.model:get('model.layers.0'), {reshard_after_froward = true})\n"),
             Catch::Contains("escape.lua:1: wrap: unknown option 'reshard_after_froward'; did you mean 'reshard_after_forward'?"));
  // Keys that are not names are shown as Lua writes them.
  CHECK_THAT(policy_error("wrap(ctx.model, {true})\n"), Catch::EndsWith("escape.lua:1: wrap: unknown option [1]"));
  CHECK_THAT(policy_error("wrap(ctx.model, {[{}] = 1})\n"), Catch::EndsWith("escape.lua:1: wrap: unknown option of type table"));
  CHECK_THAT(policy_error("local m = ctx.model:get('model.layerz')\n"), Catch::Contains("escape.lua:1: get: no module at path 'model.layerz'"));
  // A string holding a NUL byte is refused whole, not read up to the NUL ('model.layers.0').
  CHECK_THAT(policy_error("local m = ctx.model:get('model.layers.0\\0.mlp')\n"),
             Catch::Contains("escape.lua:1: get: path: holds a NUL byte"));
  CHECK_THAT(policy_error("error('custom failure')\n"), Catch::Contains("escape.lua:1: custom failure"));
  CHECK_THAT(policy_error("local x = (\n"), Catch::Contains("escape.lua:2: unexpected symbol near <eof>"));
  // Lua errors raised inside a binding (a bad pattern, a failing predicate, a failing
  // __tostring) come back through it as errors naming the policy's line.
  CHECK_THAT(policy_error("\nctx.model:find{path = '['}\n"), Catch::Contains("escape.lua:2: ") && Catch::Contains("malformed pattern"));
  CHECK_THAT(policy_error("ctx.model:find{where = function(m) error('no way') end}\n"),
             Catch::EndsWith("/escape.lua:1: no way"));  // the line once, not once per binding it crossed
  // Option tables are read raw: an __index metamethod is never run.
  CHECK(policy_error("wrap(ctx.model, setmetatable({}, {__index = function() error('sneaky') end}))\n").empty());
  CHECK_THAT(policy_error("warn(setmetatable({}, {__tostring = function() error('no text') end}))\n"),
             Catch::Contains("escape.lua:1: ") && Catch::Contains("no text"));
  CHECK_THAT(policy_error("precision{param = 'int8'}\n"), Catch::Contains("escape.lua:1: precision: ") && Catch::Contains("int8"));

  // Warnings live outside the Lua heap's cap: each is cut short, and there are few.
  CHECK_THAT(policy_error("for i = 1, 1001 do warn(i) end\n"),
             Catch::Contains("escape.lua:1: more than 1000 warnings (a warn or find inside a loop?)"));
  CHECK_THAT(policy_error("for i = 1, 1001 do ctx.model:find{class = 'Missing' .. i} end\n"),
             Catch::Contains("escape.lua:1: more than 1000 warnings (a warn or find inside a loop?)"));
  auto model = meta_model();
  // So do log lines, all together: an endless loop of them would fill a disk before the deadline.
  CHECK_THROWS_WITH(run_policy(write_policy("logs.lua", "for i = 1, 100 do log(string.rep('y', 40)) end\n"), *model, {},
                               {.log_bytes = 500}),
                    Catch::EndsWith("logs.lua:1: log: more than the 500 bytes a policy may print (a log inside a loop?)"));
  // What the engine copies out of the script is capped too, in the evaluation's process (a
  // list too long for it, copied before wrap checks it).
  CHECK_THROWS_WITH(run_policy(write_policy("flood.lua", R"(
local all, big = ctx.model:find{}, {}
for i = 1, 2000000 do big[i] = all[i % #all + 1] end
for i = 1, 1000 do wrap(big) end
)"), *model, {}, {.engine_bytes = 32u << 20}),
                    Catch::EndsWith("flood.lua:4: out of memory: the engine's share for this policy is spent (a call "
                                    "inside a loop?)"));
  // A warning is one line, whatever the script's text holds.
  const Plan escaped = run_policy(write_policy("escaped.lua", "warn('a\\nFAKE error\\27[31m')\nwrap(ctx.model)\n"), *model, {});
  REQUIRE(escaped.warnings.size() == 1);
  CHECK_THAT(escaped.warnings[0], Catch::EndsWith("escaped.lua:1: a\\nFAKE error\\x1b[31m"));
  // So is an error, a NUL in it written out with what follows it.
  CHECK_THAT(policy_error("error('abc\\0def\\255')\n"), Catch::EndsWith("escape.lua:1: abc\\x00def\\xff"));
  const Plan long_line = run_policy(write_policy("long.lua", "warn(string.rep('x', 10000))\nwrap(ctx.model)\n"), *model, {});
  REQUIRE(long_line.warnings.size() == 1);
  CHECK(long_line.warnings[0].size() < 4200);
  CHECK_THAT(long_line.warnings[0], Catch::EndsWith("xxx... (10000 bytes in all)"));
  auto plan = run_policy(write_policy("warn.lua", "for _, m in ipairs(ctx.model:find{class = 'Qwen2DecoderLayer'}) do wrap(m) end\n"
                                                 "wrap(ctx.model)\n"),
                         *model, {});
  REQUIRE(plan.warnings.size() == 1);
  CHECK_THAT(plan.warnings[0], Catch::Contains("warn.lua:1: the model has no class 'Qwen2DecoderLayer'") &&
                                   Catch::Contains("LlamaDecoderLayer"));
  // A policy that declares no unit is named, its warnings pointing at why.
  CHECK_THAT(policy_error("for _, m in ipairs(ctx.model:find{class = 'Qwen2DecoderLayer'}) do wrap(m) end\n"),
             Catch::EndsWith("escape.lua: the policy wrapped nothing: no wrap{...} call declared a unit (its warnings "
                             "above may say why)"));
  plan.units.clear();
  CHECK_THROWS_WITH(resolve_plan(plan, *model, 1, at::kFloat), Catch::Contains("policy wrapped nothing"));
}

// Each rank runs the policy in a process of its own, and ranks must plan alike.
TEST_CASE("a policy plans alike in every process: math.random is seeded, any bytes cross", "[lua]") {
  auto model = meta_model();
  const auto script = write_policy("alike.lua", R"(
local n = 0
for _ in pairs(string) do n = n + 1 end
assert(n > 10, "pairs over a library visits it")
local drawn = math.random(1000000000)
math.randomseed(0)
assert(drawn == math.random(1000000000), "math.random starts from seed 0 in every process")
warn("caf\233")
wrap(ctx.model:get("model.layers.0"))
)");
  const Plan plan = run_policy(script, *model, {});
  REQUIRE(plan.warnings.size() == 1);
  CHECK_THAT(plan.warnings[0], Catch::EndsWith("alike.lua:8: caf\\xe9"));  // the byte not UTF-8 written out
}

TEST_CASE("traversal, context and builders reach the plan", "[lua]") {
  auto model = meta_model(/*tied=*/true);
  const auto script = write_policy("api.lua", R"(
local m = ctx.model
assert(ctx.world_size == 8 and ctx.rank == 3 and ctx.training == true)
local opt = options{label = {"string"}, k = {"integer", min = 1}}; assert(opt.label == "x" and opt.k == 2)
assert(ctx.config.model_type == "llama" and ctx.config.num_hidden_layers == 3 and ctx.config.tie_word_embeddings)
assert(ctx.no_split_modules[1] == "LlamaDecoderLayer")
local layers = m:find{class = "LlamaDecoderLayer"}
assert(#layers == 3 and layers[2]:path() == "model.layers.1" and layers[2]:class_name() == "LlamaDecoderLayer")
assert(layers[1]:parent():class_name() == "ModuleList" and #layers[1]:children() == 4)
assert(#m:find{path = "mlp$"} == 3 and #m:find{where = function(x) return x:own_param_count() > 1000 end} == 2)
assert(m:get("model.norm"):parameters()[1].shape[1] == 24)
assert(m:get("model.layers.0") == layers[1] and m:param_count() == m:get("model"):param_count())
for i, layer in ipairs(layers) do
  wrap(layer, {reshard_after_forward = i < 3, activation_checkpoint = true,
               precision = precision{reduce = "bf16", output = "fp32"}, offload = offload("cpu"),
               mesh = mesh{replicate = 2, shard = 4}})
end
wrap({m:get("model.embed_tokens"), m:get("lm_head")}, {mesh = mesh{replicate = 2, shard = 4}})
)");
  auto plan = run_policy(script, *model, {.world_size = 8, .rank = 3, .options = {{"label", std::string("x")}, {"k", int64_t{2}}}});
  REQUIRE(plan.units.size() == 4);
  CHECK(plan.units[2].reshard_after_forward == 1);
  CHECK(plan.units[0].reshard_after_forward == kWholeShardGroup);
  CHECK(plan.units[0].reduce_dtype == at::kBFloat16);
  CHECK(plan.units[0].output_dtype == at::kFloat);
  CHECK(!plan.units[0].param_dtype);
  CHECK(plan.units[0].offload == Offload::cpu);
  CHECK(plan.units[0].mesh.shard == 4);
  CHECK(plan.units[3].modules == std::vector<std::string>{"model.embed_tokens", "lm_head"});
  CHECK_THAT(plan.units[0].origin, Catch::EndsWith("api.lua:14"));
  auto resolved = resolve_plan(plan, *model, 8, at::kFloat);
  CHECK(resolved.units.size() == 5);  // the root added last
}

TEST_CASE("precision{compute = 'fp8'} reaches the plan, crosses processes and needs bf16", "[lua]") {
  auto model = meta_model();
  const auto script = write_policy("fp8.lua", R"(
local layers = ctx.model:find{class = "LlamaDecoderLayer"}
wrap(layers[1], {precision = precision{param = "bf16", compute = "fp8"}})
wrap(layers[2], {precision = precision{compute = "fp8"}})
)");
  auto plan = run_policy(script, *model, {});
  REQUIRE(plan.units.size() == 2);
  CHECK(plan.units[0].compute == ProductPrecision::fp8);
  CHECK(plan.units[0].param_dtype == at::kBFloat16);
  // The plan comes back from the policy's process as text: compute survives the trip.
  CHECK(deserialize_plan(serialize_plan(plan)).units[1].compute == ProductPrecision::fp8);
  // The second unit gathers in the model's float32, which float8 products do not take.
  CHECK_THROWS_WITH(resolve_plan(plan, *model, 1, at::kFloat),
                    Catch::Contains("fp8.lua:4: precision compute = \"fp8\" needs param = \"bfloat16\"") &&
                        Catch::Contains("computes in float32"));
  const auto resolved = resolve_plan(plan, *model, 1, at::kBFloat16);
  CHECK_THAT(format_plan(resolved, 1), Catch::Contains("output as computed, compute fp8, offload none"));
  // An option's text is the policy's: written out on its own line, it forges no plan line.
  auto with_option = resolved;
  with_option.options = {{.name = "k", .accepts = "an integer", .value = "1\nunit FAKE", .doc = "x\n  unit FAKE"}};
  const std::string text = format_plan(with_option, 1);
  CHECK_THAT(text, Catch::Contains("k = 1\\nunit FAKE") && Catch::Contains("an integer; x\\n  unit FAKE\n"));
  CHECK(text.find("\nunit FAKE") == std::string::npos);
  CHECK(text.find("\n  unit FAKE") == std::string::npos);
  CHECK_THAT(plan_json(resolved, 1), Catch::Contains("\"compute\": \"fp8\""));
  CHECK_THAT(policy_error("precision{compute = 'fp16'}\n"),
             Catch::Contains("escape.lua:1: precision: compute = 'fp16' is not \"fp8\""));
  CHECK_THAT(policy_error("wrap(ctx.model, {precision = {compute = 'int4'}})\n"),
             Catch::Contains("escape.lua:1: precision: compute = 'int4' is not \"fp8\""));
}

TEST_CASE("a script opening with a byte-order mark or a #! line runs, and keeps its line numbers", "[lua]") {
  CHECK(policy_error("\xEF\xBB\xBF#!/usr/bin/env lua\nwrap(ctx.model)\n").empty());
  CHECK(policy_error("#!/usr/bin/env lua\nwrap(ctx.model)\nerror('here')\n").ends_with("escape.lua:3: here"));
  // A library file is read alike by require.
  const fs::path dir = testing::scratch_dir("policy-lib");
  fs::create_directories(dir / "lib");
  std::ofstream(dir / "lib" / "marked.lua") << "\xEF\xBB\xBF#!/usr/bin/env lua\nlocal M = {}\nM.fail = function() error('in lib') end\nreturn M\n";
  ::setenv("FSDPP_POLICY_DIR", dir.c_str(), 1);
  const std::string required = policy_error("local m = require('marked')\nwrap(ctx.model)\nm.fail()\n");
  // Modules that require each other are named, where they recursed until the C stack ended.
  std::ofstream(dir / "lib" / "ping.lua") << "return require('pong')\n";
  std::ofstream(dir / "lib" / "pong.lua") << "return require('ping')\n";
  const std::string cycle = policy_error("require('ping')\n");
  ::unsetenv("FSDPP_POLICY_DIR");
  CHECK_THAT(required, Catch::EndsWith("lib/marked.lua:3: in lib"));
  CHECK_THAT(cycle, Catch::EndsWith("lib/pong.lua:1: require: 'ping' requires itself (ping -> pong -> ping)"));
}

TEST_CASE("editing a policy file changes the plan without rebuilding", "[lua]") {
  auto model = meta_model();
  const auto path = write_policy("edit.lua", "wrap(ctx.model:get('model.layers.0'))\n");
  CHECK(run_policy(path, *model, {}).units.size() == 1);
  std::ofstream(path) << "for _, l in ipairs(ctx.model:find{class = 'LlamaDecoderLayer'}) do wrap(l) end\n";
  CHECK(run_policy(path, *model, {}).units.size() == 3);
}

TEST_CASE("a LoRA option's name that matches nothing is refused with the names it could take", "[lua]") {
  auto model = meta_model();
  const auto with = [&](const std::string& option, const std::string& names) {
    return run_policy(policy_dir() / "llama.lua", *model,
                      {.options = {{"lora_rank", int64_t{2}}, {option, names}}});
  };
  // Adapters go on Linear layers alone; any module with parameters may keep training.
  CHECK_THROWS_WITH(with("lora_targets", "q_proj,q_prj"),
                    Catch::Contains("lora_targets: 'q_prj' matches no module (Linear modules: down_proj, "));
  // Those are named by their last name, a list's numbered entries left out, modules without
  // parameters (rotary_emb) too.
  CHECK_THROWS_WITH(with("lora_trainable", "nrom"),
                    Catch::Contains("lora_trainable: 'nrom' matches no module (modules: down_proj, embed_tokens, "
                                    "gate_proj, input_layernorm, k_proj, layers, lm_head, mlp, model, norm, o_proj, "
                                    "post_attention_layernorm, q_proj, self_attn, up_proj, v_proj)"));
  CHECK(with("lora_targets", "q_proj,v_proj").lora->targets.size() == 2 * 3);  // the model's 3 layers
}

TEST_CASE("mesh{shard = 'auto'} follows the size rule for models not trained", "[lua]") {
  auto model = meta_model();
  const auto path = write_policy("auto.lua", "wrap(ctx.model:get('model.layers.0'), {mesh = mesh{shard = 'auto'}})\n");
  auto trained = run_policy(path, *model, {.world_size = 16, .training = true});
  CHECK(trained.units[0].mesh.shard == 16);
  auto frozen = run_policy(path, *model, {.world_size = 16, .training = false});
  CHECK(frozen.units[0].mesh.shard == 1);  // a small model: every rank holds it whole
  CHECK(frozen.units[0].mesh.replicate == 16);
  // A replicate that does not fit what "auto" took says what it took, and why.
  const auto misfit = write_policy("misfit.lua", "wrap(ctx.model, {mesh = mesh{shard = 'auto', replicate = 2}})\n");
  CHECK_THROWS_WITH(run_policy(misfit, *model, {.world_size = 4, .training = true}),
                    Catch::EndsWith("misfit.lua:1: mesh: shard = \"auto\" takes 4 ranks here (every rank, as a trained "
                                    "model's), and replicate 2 × 4 ≠ world 4: leave replicate out, or give shard a number"));
}

TEST_CASE("the shipped rule: mixed_mm_data keeps vision classes in the root, fused_linear_logprob lm_head", "[lua]") {
  // LlamaMLP stands in for a vision block: the rule only sees class names.
  auto model = meta_model();
  const auto script = write_policy("rule.lua", "require('fsdp').standard{vision = {'LlamaMLP'}}\n");
  auto names = [&](std::vector<GivenOption> options) {
    auto plan = run_policy(script, *model, {.world_size = 2, .options = std::move(options)});
    std::vector<std::string> out;
    for (const auto& u : plan.units) out.push_back(u.modules.size() == 1 ? u.modules[0] : "group");
    return out;
  };
  auto sharded = names({});
  CHECK(std::count(sharded.begin(), sharded.end(), "model.layers.2.mlp") == 1);
  CHECK(std::count(sharded.begin(), sharded.end(), "lm_head") == 1);
  CHECK(std::count(sharded.begin(), sharded.end(), "model.embed_tokens") == 1);
  auto mixed = names({{"mixed_mm_data", true}, {"fused_linear_logprob", true}});
  CHECK(std::count(mixed.begin(), mixed.end(), "model.layers.2.mlp") == 0);
  CHECK(std::count(mixed.begin(), mixed.end(), "lm_head") == 0);
  CHECK(std::count(mixed.begin(), mixed.end(), "model.layers.2") == 1);
  CHECK(mixed.size() + 4 == sharded.size());  // three vision units and lm_head fewer
}

TEST_CASE("freeze{...} stops the named modules' parameters from training, and resolve_plan holds them", "[lua]") {
  CHECK_THAT(policy_error("freeze({})\n"), Catch::Contains("escape.lua:1: freeze: the module list is empty"));
  CHECK_THAT(policy_error("freeze(3)\n"), Catch::Contains("freeze expects a module or a list of modules, got number"));
  CHECK_THAT(policy_error("local n = ctx.model:get('model.norm')\nfreeze(n)\nfreeze(n)\n"),
             Catch::Contains("escape.lua:3: freeze: declared twice (first at ") && Catch::Contains("escape.lua:2)"));

  auto model = meta_model();
  const auto plan = run_policy(write_policy("freeze.lua", R"(
freeze(ctx.model:find{path = "^model.layers.0$"})
wrap(ctx.model)
)"), *model, {});
  REQUIRE(plan.frozen);
  CHECK(plan.frozen->paths == std::vector<std::string>{"model.layers.0"});
  freeze_modules(plan, *model);
  for (const auto& p : unique_named_parameters(*model)) {
    CHECK(p.tensor.requires_grad() == !p.name.starts_with("model.layers.0."));
  }
  const ResolvedPlan resolved = resolve_plan(plan, *model, 1, at::kFloat);
  CHECK(resolved.trainable_numel < resolved.total_numel);
  CHECK(resolved.frozen->origin == plan.frozen->origin);
  // A LoRA run's base is frozen already; a path the model lacks is named.
  Plan both = plan;
  both.lora = LoraPlan{.targets = {"model.layers.1.self_attn.q_proj"}, .rank = 2, .alpha = 2, .origin = "l.lua:4"};
  CHECK_THROWS_WITH(freeze_modules(both, *meta_model()), Catch::Contains("freeze beside lora (l.lua:4)"));
  Plan missing{.frozen = FrozenModules{.paths = {"visual"}, .origin = "f.lua:2"}};
  CHECK_THROWS_WITH(freeze_modules(missing, *meta_model()), Catch::Contains("f.lua:2: freeze: no module at path 'visual'"));
}

TEST_CASE("lora{...} declares adapters, and apply_lora puts them on and freezes the base", "[lua]") {
  CHECK_THAT(policy_error("lora{targets = ctx.model:find{path = 'q_proj$'}, rank = 0}\n"),
             Catch::Contains("escape.lua:1: lora: rank must be an integer in [1, 65536]"));
  CHECK_THAT(policy_error("lora{targets = {}, rank = 2}\n"), Catch::Contains("escape.lua:1: lora: no target modules"));
  CHECK_THAT(policy_error("local t = ctx.model:find{path = 'q_proj$'}\nlora{targets = t, rank = 2}\nlora{targets = t, rank = 2}\n"),
             Catch::Contains("escape.lua:3: lora: declared twice (first at ") && Catch::Contains("escape.lua:2)"));
  CHECK_THAT(policy_error("lora{targets = ctx.model:find{path = 'q_proj$'}, rank = 2, dropout = 1}\n"),
             Catch::Contains("lora: dropout must be in"));

  auto model = meta_model();
  const auto plan = run_policy(write_policy("lora.lua", R"(
lora{targets = ctx.model:find{path = "proj$"}, rank = 3, alpha = 6, trainable = {ctx.model:get("model.norm")}}
wrap(ctx.model)
)"), *model, {});
  REQUIRE(plan.lora);
  CHECK(plan.lora->rank == 3);
  CHECK(plan.lora->alpha == 6);
  CHECK(plan.lora->trainable == std::vector<std::string>{"model.norm"});
  const auto meta = torch::TensorOptions().device(torch::kMeta);
  apply_lora(*model, *plan.lora, meta);
  int64_t adapters = 0, trainable = 0;
  for (const auto& p : unique_named_parameters(*model)) {
    if (!p.tensor.requires_grad()) continue;
    ++trainable;
    adapters += is_adapter_parameter(p.name);
    CHECK((is_adapter_parameter(p.name) || p.name == "model.norm.weight"));
  }
  CHECK(adapters == 2 * static_cast<int64_t>(plan.lora->targets.size()));
  CHECK(trainable == adapters + 1);
  // Dropout masks cannot be redrawn alike by a recomputation.
  Plan checkpointed{.units = {{.modules = {"model.layers.0"}, .activation_checkpoint = true, .origin = "u.lua:2"}},
                    .lora = LoraPlan{.targets = {"model.layers.0.self_attn.q_proj"}, .rank = 2, .alpha = 2,
                                     .dropout = 0.1, .origin = "u.lua:1"}};
  CHECK_THROWS_WITH(resolve_plan(checkpointed, *model, 1, at::kFloat),
                    Catch::Contains("u.lua:1: lora dropout 0.1 with") && Catch::Contains("declared at u.lua:2"));
  // A target that is no Linear is refused, naming it.
  LoraPlan wrong{.targets = {"model.layers.0.mlp"}, .rank = 2, .alpha = 2, .origin = "x.lua:1"};
  CHECK_THROWS_WITH(apply_lora(*meta_model(), wrong, meta),
                    Catch::Contains("x.lua:1: lora: target 'model.layers.0.mlp' is a LlamaMLP, not a Linear module"));
  LoraPlan root{.targets = {""}, .rank = 2, .alpha = 2, .origin = "x.lua:1"};  // the root, as messages name it
  CHECK_THROWS_WITH(apply_lora(*meta_model(), root, meta),
                    Catch::Contains("x.lua:1: lora: target '<root>' is a LlamaForCausalLM, not a Linear module"));
  // A tied head trains with its embedding or not at all: either one listed is refused.
  for (const std::string module : {"lm_head", "model.embed_tokens"}) {
    LoraPlan tied{.targets = {"model.layers.0.self_attn.q_proj"}, .rank = 2, .alpha = 2, .trainable = {module},
                  .origin = "t.lua:1"};
    CHECK_THROWS_WITH(apply_lora(*meta_model(/*tied=*/true), tied, meta),
                      Catch::StartsWith("t.lua:1: lora: trainable module '" + module + "' holds ") &&
                          Catch::Contains("(tie_word_embeddings): a tied weight cannot train beside adapters"));
  }
  // A module PEFT saves whole would load without the adapters inside it.
  for (const std::string module : {"model.layers.0.self_attn.q_proj", "model.layers.0.self_attn", "model.layers.0"}) {
    LoraPlan inside{.targets = {"model.layers.1.self_attn.q_proj", "model.layers.0.self_attn.q_proj"}, .rank = 2,
                    .alpha = 2, .trainable = {module}, .origin = "s.lua:1"};
    CHECK_THROWS_WITH(apply_lora(*meta_model(), inside, meta),
                      Catch::StartsWith("s.lua:1: lora: trainable module '" + module + "' ") &&
                          Catch::Contains(" the target 'model.layers.0.self_attn.q_proj': PEFT would load the adapter"));
  }
  LoraPlan beside{.targets = {"model.layers.0.self_attn.q_proj"}, .rank = 2, .alpha = 2,
                  .trainable = {"model.layers.0.self_attn.k_proj", "model.layers.1"}};
  CHECK_NOTHROW(apply_lora(*meta_model(), beside, meta));
  LoraPlan untied{.targets = {"model.layers.0.self_attn.q_proj"}, .rank = 2, .alpha = 2, .trainable = {"lm_head"}};
  CHECK_NOTHROW(apply_lora(*meta_model(), untied, meta));
}

TEST_CASE("options{...} declares what a policy reads: defaults, given values, checked where they were set", "[lua]") {
  auto model = meta_model();
  const auto script = write_policy("options.lua", R"(
local opt = options{
  shard = {-1, "integer", "auto", min = 1, default = -1, doc = "ranks per group"},
  rate = {"number", min = 0, max = 1, default = 0.5},
  name = {"string"},
  dtype = {"dtype"},
  flag = {"boolean", default = false},
}
assert(options{flag = {"boolean", default = false}}.flag == opt.flag)  -- the same declaration again
log(opt.shard, opt.rate, opt.name, opt.dtype, opt.flag)
wrap(ctx.model, {activation_checkpoint = opt.flag})
)");
  auto run = [&](std::vector<GivenOption> given) {
    return run_policy(script, *model, {.options = std::move(given)});
  };
  const Plan defaults = run({});
  REQUIRE(defaults.options.size() == 5);
  CHECK(defaults.options[4].name == "shard");  // by name
  CHECK(defaults.options[4].value == "-1");
  CHECK(!defaults.options[4].given);
  CHECK(defaults.options[4].accepts == "-1, an integer >= 1 or \"auto\"");
  CHECK(defaults.options[4].doc == "ranks per group");
  CHECK_THAT(defaults.options[4].origin, Catch::EndsWith("options.lua:2"));
  CHECK(defaults.options[3].accepts == "a number in [0, 1]");
  CHECK(defaults.options[2].value.empty());  // name: no default, not given
  CHECK(!defaults.units[0].activation_checkpoint);

  const Plan given = run({{"flag", true}, {"shard", std::string("auto")}, {"rate", int64_t{1}}, {"dtype", std::string("bf16")}});
  CHECK(given.units[0].activation_checkpoint);
  CHECK(given.options[1].value == "true");
  CHECK(given.options[1].given);
  CHECK(given.options[4].value == "\"auto\"");
  CHECK(given.options[3].value == "1");

  // A refused value names where it was set, the option, what it accepts and what it got.
  auto refused = [&](GivenOption option) {
    try {
      run({std::move(option)});
    } catch (const UserError& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  CHECK(refused({"shard", int64_t{0}, "run.toml:7"}) ==
        "run.toml:7: [policy.options] shard: must be -1, an integer >= 1 or \"auto\", got 0");
  CHECK(refused({"shard", 2.0, "--set policy.options.shard=2.0"}) ==
        "--set policy.options.shard=2.0: [policy.options] shard: must be -1, an integer >= 1 or \"auto\", got 2.0");
  CHECK(refused({"rate", 1.5, "run.toml:3"}) == "run.toml:3: [policy.options] rate: must be a number in [0, 1], got 1.5");
  CHECK(refused({"flag", std::string("yes"), "run.toml:4"}) ==
        "run.toml:4: [policy.options] flag: must be true or false, got \"yes\"");
  CHECK(refused({"dtype", std::string("fp8"), "run.toml:5"}) ==
        "run.toml:5: [policy.options] dtype: must be a dtype (float32, bfloat16, float16, float64), got \"fp8\"");
  CHECK(refused({"name", int64_t{3}, "run.toml:6"}) == "run.toml:6: [policy.options] name: must be a string, got 3");
  // One no declaration names: the nearest declared option, or the whole list.
  CHECK_THAT(refused({"flga", true, "run.toml:9"}),
             Catch::Equals("run.toml:9: [policy.options] flga: the policy " + script.string() +
                           " has no such option; did you mean 'flag'?"));
  CHECK_THAT(refused({"zzzzzzzz", true, "run.toml:9"}),
             Catch::EndsWith("has no such option (its options: dtype flag name rate shard)"));
  auto plain = meta_model();
  CHECK_THROWS_WITH(run_policy(write_policy("none.lua", "wrap(ctx.model)\n"), *plain, {.options = {{"k", int64_t{1}, "r.toml:2"}}}),
                    Catch::EndsWith("r.toml:2: [policy.options] k: the policy " +
                                    (testing::scratch_dir("policy") / "none.lua").string() + " has no such option; it declares no options"));
}

TEST_CASE("a bad options{...} declaration is the policy's error, at its line", "[lua]") {
  CHECK_THAT(policy_error("options{k = {'integer', min = 1, default = 0}}\n"),
             Catch::Contains("escape.lua:1: options: k: the default 0 is not an integer >= 1"));
  // A NaN reads "nan", whatever sign printf would give it.
  CHECK_THAT(policy_error("options{k = {'number', default = 0/0}}\n"),
             Catch::EndsWith("escape.lua:1: options: k: the default nan is not a number"));
  CHECK_THAT(policy_error("options{k = {0/0, default = 0/0}}\n"),
             Catch::EndsWith("escape.lua:1: options: k: the default nan is not nan"));
  CHECK_THAT(policy_error("options{k = {'number', default = math.huge}}\n"),
             Catch::Contains("escape.lua:1: options: k: the default inf is not a number"));
  CHECK_THAT(policy_error("options{k = {'integer', min = 4, max = 2}}\n"),
             Catch::Contains("escape.lua:1: options: k: min 4 is above max 2, so no number is accepted"));
  CHECK_THAT(policy_error("options{k = {'integer', mni = 1}}\n"),
             Catch::Contains("escape.lua:1: options: k: unknown key 'mni'; did you mean 'min'?"));
  CHECK_THAT(policy_error("options{k = {'integer', [2.5] = 1}}\n"), Catch::EndsWith("escape.lua:1: options: k: unknown key [2.5]"));
  CHECK_THAT(policy_error("options{k = {doc = 'x'}}\n"), Catch::Contains("escape.lua:1: options: k: names no kind or value"));
  CHECK_THAT(policy_error("options{k = 3}\n"), Catch::Contains("escape.lua:1: options: k: expected a table"));
  CHECK_THAT(policy_error("options{k = {'integer'}}\noptions{k = {'string'}}\n"),
             Catch::Contains("escape.lua:2: options: 'k' declared again differently from its declaration at ") &&
                 Catch::EndsWith("escape.lua:1 (what it accepts: an integer there, a string here)"));
  CHECK_THAT(policy_error("options{k = {'integer', doc = 'a'}}\noptions{k = {'integer', doc = 'b'}}\n"),
             Catch::EndsWith("(its doc: a there, b here)"));
  // Bounds of an option that takes no number, and names no run file can set.
  CHECK_THAT(policy_error("options{k = {'string', min = 1}}\n"),
             Catch::EndsWith("escape.lua:1: options: k: min and max bound numbers, and it takes none (kind \"integer\" or "
                             "\"number\")"));
  CHECK_THAT(policy_error("options{['bad name'] = {'string'}}\n"),
             Catch::EndsWith("escape.lua:1: options: 'bad name' is no name a run file can set (letters, digits, _ and - alone)"));
  CHECK_THAT(policy_error("options{[''] = {'string'}}\n"), Catch::Contains("options: '' is no name a run file can set"));
  // Numbers as Lua would read them back.
  CHECK_THAT(policy_error("options{k = {'number', min = 10, max = 1}}\n"),
             Catch::EndsWith("options: k: min 10 is above max 1, so no number is accepted"));
  CHECK_THAT(policy_error("lora{targets = {ctx.model:get('model.layers.0.self_attn.q_proj')}, rank = 2, alpha = -1}\n"),
             Catch::EndsWith("lora: alpha must be in [1e-06, 1e+06], got -1.0"));
}

TEST_CASE("an xpcall handler never runs once the budget is spent", "[lua]") {
  const PolicyLimits quick{.instructions = 2'000'000, .deadline = std::chrono::seconds(10)};
  // The budget ends inside the handler, or in the function with the handler to run after.
  for (const std::string script : {"xpcall(error, function() while true do end end)\n",
                                   "\nxpcall(function() while true do end end, function() while true do end end)\n",
                                   "xpcall(error, function() xpcall(error, function() while true do end end) end)\n"}) {
    INFO(script);
    // Where the handler ran unbudgeted, the deadline stopped it, with a message of its own.
    CHECK_THAT(policy_error(script, quick), Catch::Contains("escape.lua:") &&
                                                Catch::Contains(": policy exceeded its instruction budget (an endless loop?)"));
  }
  // A handler still runs for the policy's own errors.
  CHECK(policy_error("local ok, e = xpcall(error, function(m) return 'handled ' .. m end, 'x')\n"
                     "assert(not ok and e == 'handled x')\nwrap(ctx.model)\n").empty());
}

TEST_CASE("wrapping a module twice is refused at the wrap call, in the plan check's words", "[lua]") {
  // In a loop, the engine's memory filled with units (out of memory, naming no policy) before
  // the plan check saw the first twice.
  const std::string looped = policy_error("local l = ctx.model:get('model.layers.0')\nfor i = 1, 1e6 do wrap(l) end\n");
  CHECK_THAT(looped, Catch::Contains("policy error: ") &&
                         Catch::EndsWith("escape.lua:2: module 'model.layers.0' is already wrapped by " +
                                         (testing::scratch_dir("policy") / "escape.lua:2").string()));
  CHECK_THAT(policy_error("\nwrap(ctx.model)\nwrap({ctx.model})\n"),
             Catch::EndsWith("escape.lua:3: module '<root>' is already wrapped by " +
                             (testing::scratch_dir("policy") / "escape.lua:2").string()));
  CHECK_THAT(policy_error("local l = ctx.model:get('model.layers.0')\nwrap({l, l})\n"),
             Catch::EndsWith("escape.lua:2: one wrap lists module 'model.layers.0' twice"));
  CHECK_THAT(policy_error("wrap({ctx.model:get('model.layers.0.mlp'), ctx.model:get('model')})\n"),
             Catch::EndsWith("escape.lua:1: one wrap lists 'model.layers.0.mlp' and 'model', which holds it; list "
                             "either, or wrap the inner one in a unit of its own"));
  // A refused wrap declares nothing, and units still nest.
  auto model = meta_model();
  const Plan plan = run_policy(write_policy("nest.lua", "local l = ctx.model:get('model.layers.0')\nwrap(l)\n"
                                                        "assert(not pcall(wrap, l))\nwrap(l:get('mlp'))\nwrap(ctx.model)\n"),
                               *model, {});
  CHECK(plan.units.size() == 3);
}

TEST_CASE("a failed options{...} call declares none of its entries", "[lua]") {
  auto model = meta_model();
  const auto script = write_policy("half.lua", "assert(not pcall(options, {a = {'integer', default = 1}, b = {}}))\n"
                                               "options{k = {'integer'}}\n"
                                               "assert(not pcall(options, {j = {'integer'}, k = {'string'}}))\n"
                                               "wrap(ctx.model)\n");
  CHECK(run_policy(script, *model, {}).options.size() == 1);  // k alone
  for (const std::string name : {"a", "j"}) {
    CHECK_THROWS_WITH(run_policy(script, *model, {.options = {{name, int64_t{7}, "run.toml:2"}}}),
                      Catch::StartsWith("run.toml:2: [policy.options] " + name + ": the policy ") &&
                          Catch::Contains(" has no such option"));
  }
}

TEST_CASE("ctx and the tables in it are read-only, and read as tables do", "[lua]") {
  CHECK_THAT(policy_error("ctx.world_size = 99\n"), Catch::EndsWith("escape.lua:1: ctx.world_size is read-only"));
  CHECK_THAT(policy_error("ctx.config.num_hidden_layers = 1\n"),
             Catch::EndsWith("escape.lua:1: ctx.config.num_hidden_layers is read-only"));
  CHECK_THAT(policy_error("ctx.no_split_modules[1] = 'Linear'\n"),
             Catch::EndsWith("escape.lua:1: ctx.no_split_modules.1 is read-only"));
  CHECK_THAT(policy_error("setmetatable(ctx, {})\n"), Catch::EndsWith("escape.lua:1: cannot change a protected metatable"));
  CHECK(policy_error("assert(#ctx.no_split_modules >= 1 and ctx.no_split_modules[1] == 'LlamaDecoderLayer')\n"
                     "local n = 0\nfor _ in pairs(ctx.config) do n = n + 1 end\nassert(n > 3)\n"
                     "for _, c in ipairs(ctx.no_split_modules) do n = n + 1 end\n"
                     "assert(ctx.config.num_hidden_layers > 0 and table.concat(ctx.no_split_modules, ',') ~= '')\n"
                     "wrap(ctx.model)\n")
            .empty());
}

TEST_CASE("a plain table as wrap's mesh is read as mesh{...} reads it", "[lua]") {
  const std::string expected = "escape.lua:1: mesh: unknown option 'shrd'; did you mean 'shard'?";
  CHECK_THAT(policy_error("wrap(ctx.model, {mesh = {shrd = 2, replicate = 4}})\n"), Catch::EndsWith(expected));
  CHECK_THAT(policy_error("wrap(ctx.model, {mesh = mesh{shrd = 2}})\n"), Catch::EndsWith(expected));
  CHECK(policy_error("wrap(ctx.model, {mesh = {shard = 2, replicate = 2}})\n").empty());
  // Its defaults and "auto" too: the replicas the world leaves over the shard.
  auto model = meta_model();
  const auto path = write_policy("plain_mesh.lua", "wrap(ctx.model:get('model.layers.0'), {mesh = {shard = 2}})\n"
                                                   "wrap(ctx.model:get('model.layers.1'), {mesh = {shard = 'auto'}})\n"
                                                   "wrap(ctx.model, {mesh = mesh{shard = 2}})\n");
  const auto plan = run_policy(path, *model, {.world_size = 4, .training = false});
  REQUIRE(plan.units.size() == 3);
  CHECK(plan.units[0].mesh.replicate == 2);
  CHECK(plan.units[0].mesh.shard == 2);
  CHECK(plan.units[1].mesh.replicate == 4);  // "auto" for a small model not trained: one rank
  CHECK(plan.units[1].mesh.shard == 1);
  CHECK(plan.units[2].mesh.replicate == plan.units[0].mesh.replicate);
  CHECK(plan.units[2].mesh.shard == plan.units[0].mesh.shard);
}

TEST_CASE("m:parameters() names dtypes as precision{...} does", "[lua]") {
  const auto script = write_policy("dtype.lua", "local p = ctx.model:get('model.norm'):parameters()[1]\nwarn(p.dtype)\n"
                                                "wrap(ctx.model, {precision = precision{param = p.dtype}})\n");
  for (const auto& [dtype, name] : {std::pair{at::kFloat, "float32"}, {at::kBFloat16, "bfloat16"}}) {
    auto config = meta_model()->config();
    auto model = build_model(config, torch::TensorOptions().device(torch::kMeta).dtype(dtype));
    const Plan plan = run_policy(script, *model, {});
    REQUIRE(plan.warnings.size() == 1);
    CHECK_THAT(plan.warnings[0], Catch::EndsWith(std::string("dtype.lua:2: ") + name));
    CHECK(plan.units[0].param_dtype == dtype);
  }
}

TEST_CASE("no pcall swallows a passed cap: the policy fails at the call that passed it", "[lua]") {
  CHECK_THAT(policy_error("for i = 1, 1001 do pcall(warn, 'w') end\nwrap(ctx.model)\n"),
             Catch::EndsWith("escape.lua:1: more than 1000 warnings (a warn or find inside a loop?)"));
  // Nor an xpcall handler, nor a pcall around the loop.
  CHECK_THAT(policy_error("pcall(function()\n  for i = 1, 1001 do warn('w') end\nend)\nwrap(ctx.model)\n"),
             Catch::EndsWith("escape.lua:2: more than 1000 warnings (a warn or find inside a loop?)"));
  CHECK_THAT(policy_error("xpcall(function() for i = 1, 1001 do warn('w') end end, function(e) return 'fine' end)\n"
                          "wrap(ctx.model)\n"),
             Catch::EndsWith("escape.lua:1: more than 1000 warnings (a warn or find inside a loop?)"));
  auto model = meta_model();
  CHECK_THROWS_WITH(run_policy(write_policy("logs.lua", "\nfor i = 1, 100 do pcall(log, string.rep('y', 40)) end\n"
                                                        "wrap(ctx.model)\n"),
                               *model, {}, {.log_bytes = 500}),
                    Catch::EndsWith("logs.lua:2: log: more than the 500 bytes a policy may print (a log inside a loop?)"));
}

TEST_CASE("load takes mode and env as Lua's does, and its chunks' errors name the policy's line", "[lua]") {
  CHECK(policy_error(R"(
assert(load("return y", "n", "t", {y = 5})() == 5)
local env = {}
load("x = 1", "n", "t", env)()
assert(env.x == 1)
local f, e = load("return 1", "n", "b")
assert(f == nil and e:find("attempt to load a text chunk"), e)
assert(load("return 2", nil, "bt")() == 2)
wrap(ctx.model)
)").empty());
  CHECK_THAT(policy_error("local f = load('return y', 'n', 't', nil)\nf()\n"),
             Catch::EndsWith("escape.lua:2: [string \"n\"]:1: attempt to index a nil value (upvalue '_ENV')"));
  CHECK_THAT(policy_error("local f = load('\\nerror(\"boom\")', '=fake.lua:99')\n\nf()\n"),
             Catch::EndsWith("escape.lua:3: fake.lua:99:2: boom"));
  // A chunk name of a file's form is no file's.
  CHECK_THAT(policy_error("load('error(\"x\")', '@policies/lib/fsdp.lua')()\n"),
             Catch::EndsWith("escape.lua:1: policies/lib/fsdp.lua:1: x"));
  CHECK_THAT(policy_error("load('leak = 1')()\n"), Catch::EndsWith("escape.lua:1: (load):1: assignment to undeclared "
                                                                   "global 'leak' (use local)"));
  // Through a binding's callback, the policy's line once.
  CHECK_THAT(policy_error("ctx.model:find{where = load('error(\"no\")')}\n"), Catch::EndsWith("escape.lua:1: (load):1: no"));
}

TEST_CASE("the memory cap's message names the line the script was running", "[lua]") {
  const PolicyLimits quick{.instructions = 50'000'000, .memory_bytes = 8u << 20, .deadline = std::chrono::seconds(10)};
  CHECK_THAT(policy_error("local t = {}\nwhile true do t[#t + 1] = {} end\n", quick),
             Catch::EndsWith("escape.lua:2: policy exceeded its memory cap of 8 MiB"));
}

TEST_CASE("a lone option kind misspelt is an error, not a literal", "[lua]") {
  CHECK_THAT(policy_error("options{n = {'interger'}}\n"),
             Catch::EndsWith("escape.lua:1: options: n: unknown kind 'interger'; did you mean 'integer'?"));
  // Another language's name for a kind, listed alone, is one too.
  for (const auto& [name, kind] : {std::pair{"int", "integer"}, {"bool", "boolean"}, {"float", "number"},
                                   {"double", "number"}, {"str", "string"}}) {
    CHECK_THAT(policy_error(std::string("options{n = {'") + name + "'}}\n"),
               Catch::EndsWith(std::string("options: n: unknown kind '") + name + "'; did you mean '" + kind + "'?"));
  }
  // Literals beside others, or far from any kind, are literals.
  CHECK(policy_error("local o = options{mode = {'bool', 'int', default = 'bool'}, k = {'auto', default = 'auto'}}\n"
                     "assert(o.mode == 'bool' and o.k == 'auto')\nwrap(ctx.model)\n").empty());
}
