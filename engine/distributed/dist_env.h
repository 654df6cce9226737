// Where this process stands in a distributed run, read from the variables torchrun and
// `fsdpp launch` set (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
// MASTER_PORT) or, failing those, from Slurm's, and the world group a run's [parallel]
// section asks for.
#pragma once

#include "distributed/comm.h"
#include "distributed/parallel_config.h"

#include <memory>
#include <string>

namespace fsdpp {

struct DistEnv {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;

  // UserError naming the variable when one is malformed or inconsistent.
  static DistEnv from_environment();
};

// Why `host` resolves to no address (the resolver's reason), or "" when it resolves.
std::string unresolved_reason(const std::string& host);

// The world group for `env` on the device the config asks for, which becomes this thread's
// current device. A world of one, launched or a plain process alike, is a group of one with
// no backend: its collectives are its own values, and no rendezvous is needed.
std::shared_ptr<Comm> init_distributed(const DistEnv& env, const ParallelConfig& config);

}  // namespace fsdpp
