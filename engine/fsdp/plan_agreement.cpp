// Comparing the ranks' resolved plans by a checksum of the plan's JSON, less where the policy
// declared each part: ranks whose machines keep the policy file at other paths plan alike.
#include "fsdp/plan_agreement.h"

#include "core/checksum.h"
#include "core/error.h"
#include "fsdp/plan_text.h"

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <string>

namespace fsdpp {

namespace {

void erase_origins(nlohmann::json& j) {
  if (j.is_object()) j.erase("origin");
  if (!j.is_structured()) return;
  for (auto& child : j) erase_origins(child);
}

}  // namespace

void require_same_plan(const ResolvedPlan& plan, Comm& world) {
  if (world.size() == 1) return;
  nlohmann::json json = nlohmann::json::parse(plan_json(plan, world.size()));
  erase_origins(json);
  const std::string text = json.dump();
  const at::Tensor mine = at::tensor({static_cast<int64_t>(crc32c(text.data(), text.size()))}, at::kLong);
  at::Tensor all = at::empty({world.size()}, at::kLong);  // [world]
  world.all_gather(all, mine);
  const auto sums = all.accessor<int64_t, 1>();
  // The policy file, from where it declared its first unit ("policies/llama.lua:4").
  const std::string origin = plan.units.empty() ? std::string() : plan.units.front().declared.origin;
  const std::string policy = origin.empty() ? "plan" : origin.substr(0, origin.rfind(':'));
  for (int r = 1; r < world.size(); ++r) {
    if (sums[r] != sums[0]) {
      throw UserError(policy + ": rank " + std::to_string(r) + "'s plan differs from rank 0's (its units, meshes, " +
                      "precision or their order): a policy must plan alike on every rank, whatever ctx.rank, " +
                      "math.random or the order pairs() visits a table in");
    }
  }
}

}  // namespace fsdpp
