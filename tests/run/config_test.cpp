// Run files: every section parsed into its own config, errors that name file, line and the
// nearest valid key, type checks, validation messages and --set overrides.
#include "core/error.h"
#include "run/run_config.h"
#include "scratch_dir.h"

#include <catch2/catch.hpp>

#include <filesystem>
#include <fstream>

using namespace fsdpp;
namespace fs = std::filesystem;

namespace {

fs::path write_toml(const std::string& text) {
  static int counter = 0;
  auto path = testing::scratch_dir("cfg") / (std::to_string(counter++) + ".toml");
  std::ofstream(path) << text;
  return path;
}

const char* kValid = R"([model]
path = "m"
[data]
train = "t.tok"
seq_len = 64
[optimizer]
lr = 1e-3
[scheduler]
kind = "linear"
warmup_steps = 5
[train]
steps = 20
out_dir = "out"
)";

std::string error_of(const fs::path& path, const std::vector<std::string>& overrides = {}) {
  try {
    RunConfig::load(path, overrides);
  } catch (const UserError& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST_CASE("a valid run file fills every section, with defaults for the rest", "[train][config]") {
  auto run = RunConfig::load(write_toml(kValid), {});
  CHECK(run.model.path == "m");
  CHECK(run.data.seq_len == 64);
  CHECK(run.data.batch_size == 8);
  CHECK(run.optimizer.lr == Approx(1e-3));
  CHECK(run.scheduler.kind == Decay::linear);
  CHECK(run.train.steps == 20);
  CHECK(run.checkpoint.dir == "out/checkpoints");
  CHECK(run.checkpoint.export_dir == "out/model");
  CHECK(run.checkpoint.keep == 3);
  CHECK(run.metrics.jsonl == "out/metrics.jsonl");
}

TEST_CASE("overrides from --set replace a key, read as TOML or as a bare string", "[train][config]") {
  auto run = RunConfig::load(write_toml(kValid),
                             {"train.steps=7", "optimizer.lr=0.5", "model.path=other/dir", "data.seed=3"});
  CHECK(run.train.steps == 7);
  CHECK(run.optimizer.lr == Approx(0.5));
  CHECK(run.model.path == "other/dir");
  CHECK(run.data.seed == 3);
  CHECK_THAT(error_of(write_toml(kValid), {"train.steps=many"}),
             Catch::Contains("--set train.steps=many") && Catch::Contains("expected an integer"));
  CHECK_THAT(error_of(write_toml(kValid), {"nodot"}), Catch::Contains("section.key=value"));
}

TEST_CASE("config errors name the file, the line and what would be valid", "[train][config]") {
  SECTION("unknown key with the nearest valid one") {
    // [train] is the last section, so the stray key lands there.
    auto msg = error_of(write_toml(std::string(kValid) + "stpes = 3\n"));
    CHECK_THAT(msg, Catch::Contains(".toml:14: [train] stpes: unknown key; did you mean 'steps'?"));
  }
  SECTION("unknown section") {
    auto msg = error_of(write_toml(std::string(kValid) + "[optimiser]\nlr = 1\n"));
    CHECK_THAT(msg, Catch::Contains(":14: unknown section [optimiser]; did you mean 'optimizer'?"));
  }
  SECTION("wrong type") {
    auto msg = error_of(write_toml(R"([model]
path = "m"
[data]
train = "t"
seq_len = "long"
)"));
    CHECK_THAT(msg, Catch::Contains(".toml:5: [data] seq_len: expected an integer, got a string"));
  }
  SECTION("invalid value") {
    auto msg = error_of(write_toml(std::string(kValid) + "grad_accum = 0\n"));
    CHECK_THAT(msg, Catch::Contains(":14: [train] grad_accum: must be in [1, 1000000], got 0"));
  }
  SECTION("missing required key") {
    // A run fed by its caller (Python) reads no [data]; one drawing its own batches needs it.
    const RunConfig config = RunConfig::load(write_toml("[model]\npath = \"m\"\n"), {});
    CHECK(config.data.train.empty());
    CHECK_THROWS_WITH(config.require_data(), Catch::EndsWith(".toml: [data] train: required: the token file to train on"));
  }
  SECTION("invalid TOML") {
    CHECK_THAT(error_of(write_toml("[model]\npath = \n")), Catch::Contains(".toml:2: invalid TOML"));
  }
  SECTION("missing file") {
    CHECK_THAT(error_of("/nonexistent/run.toml"), Catch::Contains("/nonexistent/run.toml: no such config file"));
  }
}
