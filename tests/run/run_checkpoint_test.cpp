// What a checkpoint keeps of the run beside its state (ClientState), through its JSON: a
// loss that was not finite is written as null, JSON having no NaN, and read back as NaN.
#include "run/run.h"

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <cmath>
#include <limits>

using namespace fsdpp;

TEST_CASE("client state survives its JSON, a loss that was not finite included", "[checkpoint]") {
  const ClientState saved{.skipped_steps = 3, .tokens_seen = 4096, .loss = 2.5};
  const nlohmann::json text = nlohmann::json::parse(nlohmann::json(saved).dump());
  const auto read = text.get<ClientState>();
  CHECK(read.skipped_steps == 3);
  CHECK(read.tokens_seen == 4096);
  CHECK(read.loss == 2.5);

  const ClientState diverged{.skipped_steps = 1, .tokens_seen = 64, .loss = std::numeric_limits<double>::quiet_NaN()};
  const nlohmann::json written = nlohmann::json::parse(nlohmann::json(diverged).dump());
  CHECK(written.at("loss").is_null());
  CHECK(std::isnan(written.get<ClientState>().loss));
}
