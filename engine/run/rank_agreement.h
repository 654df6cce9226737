// Every rank of a run must train by the same settings: each step's collectives, and the rows
// each rank takes, are matched across ranks by step and size. Ranks started by hand (a
// torchrun command per node, `fsdpp launch --nnodes` given other --set values per node) can
// be given others: a step count, evaluation or save interval that differs hangs a collective
// until [parallel] timeout_s, and a learning rate, sequence length or model that differs
// trains on silently. This check refuses both after the rendezvous, before any step.
#pragma once

#include "distributed/comm.h"
#include "run/run_config.h"

#include <cstdint>
#include <map>
#include <optional>

namespace fsdpp {

// A collective over `world`: UserError on every rank, naming the first rank whose settings
// differ from rank 0's and each setting that does, unless all ranks agree. The settings are
// the run file's less the paths of what it reads (nodes may keep the files at other paths;
// require_same_sources compares their contents) and its timeout, the directories it writes
// into, the fields of the model's config.json that change what it computes, and the step a
// resumed run goes on after.
void require_same_settings(const RunConfig& config, std::optional<int64_t> resumed_step, Comm& world);
// A collective over `world`, as require_same_settings: UserError on every rank, naming the first
// rank and each file whose contents differ from rank 0's, unless all agree. `sources` maps what
// a rank read (the model's weights, the checkpoint it resumes, its token file) to what
// identifies its contents: the paths may differ from node to node, the contents may not.
void require_same_sources(const std::map<std::string, std::string>& sources, Comm& world);

}  // namespace fsdpp
