// Environment rendezvous.
#include "distributed/dist_env.h"

#include "core/device.h"
#include "core/error.h"
#include "core/log.h"

#include <netdb.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <csignal>
#include <cstdlib>
#include <limits>

namespace fsdpp {

namespace {

const char* env(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? v : nullptr;
}

// The variable `name` as a whole number in [low, high], or `fallback` where it is unset.
int env_int(const char* name, int fallback, long low = 0, long high = std::numeric_limits<int>::max()) {
  const char* v = env(name);
  if (v == nullptr) return fallback;
  char* end = nullptr;
  errno = 0;
  const long value = std::strtol(v, &end, 10);
  if (*end != '\0' || errno == ERANGE || value < low || value > high) {
    throw UserError(std::string("environment: ") + name + "='" + v + "' is not a whole number in [" +
                    std::to_string(low) + ", " + std::to_string(high) + "]");
  }
  return static_cast<int>(value);
}

// Slurm's first node name from a list like "node[03-05],gpu7" ("node03").
std::string first_host(std::string list) {
  list = list.substr(0, list.find(','));
  const auto bracket = list.find('[');
  if (bracket == std::string::npos) return list;
  std::string range = list.substr(bracket + 1);
  return list.substr(0, bracket) + range.substr(0, range.find_first_of("-,]"));
}

}  // namespace

DistEnv DistEnv::from_environment() {
  DistEnv e;
  if (env("RANK") && env("WORLD_SIZE")) {
    e.rank = env_int("RANK", 0);
    e.world_size = env_int("WORLD_SIZE", 1);
    // A batch script that exports RANK and WORLD_SIZE alone, under Slurm, leaves the node's
    // share to Slurm's variables.
    e.local_rank = env_int("LOCAL_RANK", env("SLURM_LOCALID") ? env_int("SLURM_LOCALID", 0) : e.rank);
    e.local_world_size = env_int("LOCAL_WORLD_SIZE", env("SLURM_NTASKS_PER_NODE")
                                                         ? std::min(env_int("SLURM_NTASKS_PER_NODE", 1), e.world_size)
                                                         : e.world_size);
    if ((env("LOCAL_RANK") || env("LOCAL_WORLD_SIZE")) &&
        (e.local_world_size < 1 || e.local_rank >= e.local_world_size || e.local_world_size > e.world_size)) {
      throw UserError("environment: LOCAL_RANK " + std::to_string(e.local_rank) + " of LOCAL_WORLD_SIZE " +
                      std::to_string(e.local_world_size) + " does not fit a world of " + std::to_string(e.world_size));
    }
  } else if (env("SLURM_PROCID") && env("SLURM_NTASKS")) {
    e.rank = env_int("SLURM_PROCID", 0);
    e.world_size = env_int("SLURM_NTASKS", 1);
    e.local_rank = env_int("SLURM_LOCALID", 0);
    e.local_world_size = env_int("SLURM_NTASKS_PER_NODE", e.world_size);
    if (!env("MASTER_ADDR") && env("SLURM_JOB_NODELIST")) e.master_addr = first_host(env("SLURM_JOB_NODELIST"));
  } else if (env("RANK") || env("WORLD_SIZE")) {
    // Half a launcher's environment is a mistake to name, not a world of one to train alone.
    throw UserError(std::string("environment: ") + (env("RANK") ? "RANK" : "WORLD_SIZE") + " is set and " +
                    (env("RANK") ? "WORLD_SIZE" : "RANK") + " is not; a launcher sets both (fsdpp launch, torchrun)");
  }
  if (const char* addr = env("MASTER_ADDR")) e.master_addr = addr;
  e.master_port = env_int("MASTER_PORT", e.master_port, 1, 65535);
  if (e.world_size < 1) throw UserError("environment: WORLD_SIZE must be at least 1");
  if (e.rank >= e.world_size) {
    throw UserError("environment: RANK " + std::to_string(e.rank) + " is not below WORLD_SIZE " +
                    std::to_string(e.world_size));
  }
  return e;
}

std::string unresolved_reason(const std::string& host) {
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  const int rc = ::getaddrinfo(host.c_str(), nullptr, &hints, &found);
  if (rc == 0) {
    ::freeaddrinfo(found);
    return "";
  }
  return ::gai_strerror(rc);
}

std::shared_ptr<Comm> init_distributed(const DistEnv& env, const ParallelConfig& config) {
  // Without NCCL in this build a world of several ranks must talk over gloo, hence compute
  // on the CPU; a world of one talks to no one.
  const bool single = env.world_size == 1;
  const bool gpu_groups = single || nccl_available();
  const DeviceChoice choice =
      config.device == DeviceChoice::automatic && !gpu_groups ? DeviceChoice::cpu : config.device;
  const c10::Device device = resolve_device(choice, env.local_rank, env.local_world_size, config.gpu_asked_by);
  use_device(device);
  if (single) {
    if (!device.is_cpu()) log_info("device: ", device.str());
    return Comm::single(device);
  }
  // Under fsdpp launch every line already carries its rank; torchrun and srun add none.
  if (std::getenv("FSDPP_LAUNCHER_PREFIXES_RANK") == nullptr) set_log_rank(env.rank);
  // A rank that stopped closes its sockets. A collective still sending to it (one issued
  // ahead, from the backend's thread) must fail with an error this rank reports, not be
  // killed by SIGPIPE, which would hide the stopped rank's own message.
  std::signal(SIGPIPE, SIG_IGN);
  // A name that resolves to nothing would be retried until the timeout; a master that is
  // merely not up yet is worth that wait, which the log states.
  if (const std::string why = unresolved_reason(env.master_addr); !why.empty()) {
    throw UserError("MASTER_ADDR " + env.master_addr + " does not resolve (" + why + ")");
  }
  if (env.local_rank == 0 && env.world_size > env.local_world_size) {  // several nodes: one may start late
    log_info("rendezvous: ", env.world_size, " ranks at ", env.master_addr, ":", env.master_port, ", waiting up to ",
             config.timeout_s, " s ([parallel] timeout_s) for all of them");
  }
  const auto timeout = std::chrono::milliseconds(static_cast<int64_t>(config.timeout_s * 1000));
  auto comm = Comm::world(env.rank, env.world_size, env.master_addr, env.master_port, timeout, device);
  if (env.rank == 0) {
    log_info("distributed: ", env.world_size, " ranks over ", device.is_cpu() ? "gloo" : "nccl", " on ",
             device.is_cpu() ? std::string("CPUs") : std::string("GPUs"), " via ", env.master_addr, ":",
             env.master_port);
  }
  return comm;
}

}  // namespace fsdpp
