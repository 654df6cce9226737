// Comparing the ranks' resolved plans by a checksum of the text `fsdpp plan` prints.
#include "fsdp/plan_agreement.h"

#include "core/checksum.h"
#include "core/error.h"
#include "fsdp/plan_text.h"

#include <ATen/ATen.h>

#include <string>

namespace fsdpp {

void require_same_plan(const ResolvedPlan& plan, Comm& world) {
  if (world.size() == 1) return;
  const std::string text = format_plan(plan, world.size());
  const at::Tensor mine = at::tensor({static_cast<int64_t>(crc32c(text.data(), text.size()))}, at::kLong);
  at::Tensor all = at::empty({world.size()}, at::kLong);  // [world]
  world.all_gather(all, mine);
  const auto sums = all.accessor<int64_t, 1>();
  for (int r = 1; r < world.size(); ++r) {
    if (sums[r] != sums[0]) {
      throw UserError("plan: rank " + std::to_string(r) + "'s plan differs from rank 0's (its units, meshes, " +
                      "precision or their order): a policy must plan alike on every rank, whatever ctx.rank, " +
                      "math.random or the order pairs() visits a table in");
    }
  }
}

}  // namespace fsdpp
