// The room a run's outputs need on disk, checked against the real filesystem of a scratch
// directory: sizes no disk holds are refused naming every figure, and sizes any disk holds
// pass; the run's own refusal on a full disk is in tests/run/checkpoint_faults.sh.
#include "core/error.h"
#include "run/outputs.h"
#include "run/run_config.h"
#include "scratch_dir.h"

#include <catch2/catch.hpp>

#include <filesystem>
#include <fstream>

using namespace fsdpp;
namespace fs = std::filesystem;

namespace {

// A run file whose outputs all lie in a fresh scratch directory.
RunConfig run_in_scratch() {
  const fs::path dir = testing::scratch_dir("outputs");
  std::ofstream(dir / "run.toml") << "[model]\npath = \"m\"\n[data]\ntrain = \"t.tok\"\n[train]\nsteps = 10\n"
                                  << "out_dir = \"" << (dir / "out").string() << "\"\n";
  RunConfig config = RunConfig::load(dir / "run.toml", {});
  fs::create_directories(config.checkpoint.dir);
  return config;
}

std::string refusal(const RunConfig& config, const OutputSizes& sizes) {
  try {
    check_room_for_outputs(config, sizes);
  } catch (const UserError& e) {
    return e.what();
  }
  return "";
}

constexpr uint64_t kNoDiskHolds = uint64_t{1} << 62;  // 4.6 EB

}  // namespace

TEST_CASE("a run's checkpoint or export larger than the disk's free space is refused", "[run]") {
  const RunConfig config = run_in_scratch();
  const std::string unset = " (unset: in [train] out_dir): ";
  const std::string checkpoint = refusal(config, {.checkpoint = kNoDiskHolds, .exported = 1000, .saves = 1});
  CHECK_THAT(checkpoint,
             Catch::Contains("run.toml:") && Catch::Contains("[checkpoint] dir" + unset + config.checkpoint.dir));
  CHECK_THAT(checkpoint, Catch::Contains("free on its filesystem, and a checkpoint of this run takes 4.61e+09 GB") &&
                             Catch::Contains("its first save would fail"));
  // Each node writes its share, which is what rank 0's disk must hold at the least.
  CHECK_THAT(refusal(config, {.checkpoint = kNoDiskHolds, .saves = 1, .nodes = 4}),
             Catch::Contains("takes 1.15e+09 GB at the least") && Catch::Contains("this node's share of 4 nodes"));
  CHECK_THAT(refusal(config, {.checkpoint = 1000, .exported = kNoDiskHolds, .saves = 1}),
             Catch::Contains("[checkpoint] export_dir" + unset + config.checkpoint.export_dir) &&
                 Catch::Contains("the export at the end takes 4.61e+09 GB") &&
                 Catch::Contains("beside the last checkpoint's"));
}

TEST_CASE("a run whose outputs fit, or that saves nothing, passes", "[run]") {
  const RunConfig config = run_in_scratch();
  CHECK(refusal(config, {.checkpoint = 1000, .exported = 1000, .saves = 5}).empty());
  // No save, no export: no checkpoint's size matters.
  CHECK(refusal(config, {.checkpoint = kNoDiskHolds, .saves = 0}).empty());
}
