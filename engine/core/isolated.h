// Running a function where nothing it does can hang or crash the caller: in a forked child,
// under a wall-clock deadline, its result coming back through a pipe. For code that cannot
// be interrupted from inside (a C routine looping in a script's pattern match, a kernel
// that faults on an instruction the CPU advertises but does not enable).
#pragma once

#include <chrono>
#include <cstddef>
#include <functional>
#include <string>

namespace fsdpp {

struct IsolatedResult {
  enum class End {
    finished,   // the function returned: `output` is its value
    failed,     // it threw: `output` is the exception's message
    timed_out,  // still running at the deadline: the child was killed
    died,       // the child ended without a result: `signal` ended it, or 0 for an exit
  };
  End end = End::died;
  std::string output;
  int signal = 0;
};

// Runs `body` in a child process of this one (a copy of its memory at the call) and waits at
// most `deadline` for it. The child never returns into the caller's code. With `growth_bytes`,
// the child's address space may grow that much past its size at the fork: beyond it an
// allocation fails (std::bad_alloc), where it would have taken the machine's memory first.
IsolatedResult run_isolated(const std::function<std::string()>& body, std::chrono::milliseconds deadline,
                            size_t growth_bytes = 0);

}  // namespace fsdpp
