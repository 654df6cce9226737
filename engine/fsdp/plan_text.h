// A wrap plan as people and processes read it: the resolved unit tree and per-rank memory
// that `fsdpp plan` prints (text or JSON), and the declared plan as JSON text (a policy
// evaluated in another process hands its plan over this way).
#pragma once

#include "fsdp/plan.h"

#include <string>

namespace fsdpp {

// The unit tree and per-rank memory as text, or as JSON.
std::string format_plan(const ResolvedPlan& plan, int world);
std::string plan_json(const ResolvedPlan& plan, int world);
// A declared plan as text and back, every field kept: how a policy evaluated in another
// process hands its plan over.
std::string serialize_plan(const Plan& plan);
Plan deserialize_plan(const std::string& text);

}  // namespace fsdpp
