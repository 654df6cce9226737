// Catch2's main for the fsdpp unit tests; one intra-op thread keeps runs repeatable and
// leaves cores to the multi-process tests that run beside it.
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

#include <ATen/Parallel.h>

int main(int argc, char** argv) {
  at::set_num_threads(1);
  return Catch::Session().run(argc, argv);
}
