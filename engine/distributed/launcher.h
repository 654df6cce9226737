// `fsdpp launch`: starts this node's ranks as child processes of the same binary with the
// rendezvous variables set, prefixes every line they print with their rank, forwards
// SIGINT/SIGTERM, and when one rank fails stops the others and reports which rank and how.
#pragma once

#include <string>
#include <vector>

namespace fsdpp {

struct LaunchOptions {
  int nproc_per_node = 1;           // ranks on this node
  int nnodes = 1;                   // nodes in the job
  int node_rank = 0;                // this node's index
  std::string master_addr = "127.0.0.1";  // where rank 0 serves the rendezvous store
  int master_port = 0;              // 0: a free port (one node) or 29500 (several)
  double grace_s = 5.0;             // after SIGTERM, seconds before the remaining ranks get SIGKILL
  std::vector<std::string> command; // the fsdpp command each rank runs, e.g. {"train", "run.toml"}
};

// Runs the ranks to completion: 0 when every rank succeeded, 128 + the signal when a
// forwarded SIGINT or SIGTERM stopped them all cleanly, else 1.
int launch(const LaunchOptions& options, const std::string& self_exe);

}  // namespace fsdpp
