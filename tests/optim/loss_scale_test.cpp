// The dynamic loss scale: growth after growth_interval finite steps, back-off on an overflow,
// the floor min_scale it backs off to, and the stop at that floor; the run file's checks.
#include "core/error.h"
#include "optim/loss_scale.h"
#include "run/run_config.h"
#include "scratch_dir.h"

#include <catch2/catch.hpp>

#include <fstream>

using namespace fsdpp;

TEST_CASE("the loss scale grows, backs off no lower than min_scale, and stops a run that overflows there",
          "[optim]") {
  const LossScaleConfig config{.init_scale = 64.0, .growth_factor = 2.0, .backoff_factor = 0.25,
                               .min_scale = 2.0, .growth_interval = 3};
  LossScaler scaler(config);
  for (int step = 0; step < 3; ++step) scaler.update(true);
  CHECK(scaler.scale() == 128.0);
  scaler.update(false);  // 32
  scaler.update(false);  // 8
  scaler.update(false);  // 2, not 0.5: the floor
  CHECK(scaler.scale() == 2.0);
  CHECK(scaler.state().growth_tracker == 0);
  CHECK_THROWS_AS(scaler.update(false), EveryRankError);
  CHECK_THROWS_WITH(scaler.update(false),
                    Catch::StartsWith("loss scale: a step's gradients are not finite at [loss_scale] min_scale = 2, "
                                      "the lowest the scale backs off to (from init_scale 64)"));
  scaler.update(true);  // the run that goes on regardless counts toward growth again
  CHECK(scaler.state().growth_tracker == 1);
}

TEST_CASE("a restored scale below min_scale starts at the floor, its growth count kept", "[optim]") {
  LossScaler scaler({.init_scale = 64.0, .min_scale = 2.0});
  scaler.restore({.scale = 0.5, .growth_tracker = 7});  // saved under a lower floor
  CHECK(scaler.scale() == 2.0);
  CHECK(scaler.state().growth_tracker == 7);
  scaler.restore({.scale = 16.0, .growth_tracker = 1});
  CHECK(scaler.scale() == 16.0);
}

TEST_CASE("[loss_scale] min_scale is range-checked and no higher than init_scale", "[optim][config]") {
  const auto path = testing::scratch_dir("loss-scale") / "run.toml";
  std::ofstream(path) << "[model]\npath = \"m\"\n[loss_scale]\ninit_scale = 1024\nmin_scale = 4096\n";
  CHECK_THROWS_WITH(RunConfig::load(path, {}), Catch::Contains("run.toml:5") && Catch::Contains(
                        "[loss_scale] min_scale: must not be above init_scale 1024, got 4096"));
  CHECK_THROWS_WITH(RunConfig::load(path, {"loss_scale.min_scale=0"}), Catch::Contains("min_scale"));
  CHECK(RunConfig::load(path, {"loss_scale.min_scale=0.5"}).loss_scale.min_scale == 0.5);
}
