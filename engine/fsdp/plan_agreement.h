// Every rank must shard by one plan: the same units, meshes, precision and order, since each
// unit's collectives and a checkpoint's rows are matched across ranks by their place in it.
// A policy runs once per rank, so one that reads ctx.rank, draws from math.random without a
// seed, or wraps in the order pairs() visits a table (Lua seeds its string hashes per process)
// can plan differently on each; this check refuses that before the first collective of a unit.
#pragma once

#include "distributed/comm.h"
#include "fsdp/plan.h"

namespace fsdpp {

// A collective over `world`: UserError on every rank, naming the first rank whose plan differs
// from rank 0's, unless all ranks resolved the same plan.
void require_same_plan(const ResolvedPlan& plan, Comm& world);

}  // namespace fsdpp
