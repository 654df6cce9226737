// Catch2's main for the fsdpp unit tests; one intra-op thread keeps runs repeatable and
// leaves cores to the multi-process tests that run beside it. The CPU's bf16 kernels are
// settled first, as the fsdpp binary settles them (core/cpu_kernels.h).
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

#include "core/cpu_kernels.h"

#include <ATen/Parallel.h>

int main(int argc, char** argv) {
  fsdpp::settle_cpu_kernels(argv);
  at::set_num_threads(1);
  return Catch::Session().run(argc, argv);
}
