"""Gives a Python program the CPU kernels fsdpp settles on for this machine: `fsdpp probe`
prints the oneDNN cap a CPU needs when it advertises AMX without enabling it (where bf16
products would die with SIGILL), and apply() puts it in this process's environment, which
child processes inherit. Call it before torch runs a kernel; oneDNN reads the cap on first
use. Shared by the benchmarks' peers and the tests' Python references."""
import os
import subprocess


def apply(fsdpp=None):
    """`fsdpp`: the binary to ask (default: $FSDPP; without either, nothing is done)."""
    fsdpp = fsdpp or os.environ.get("FSDPP")
    if not fsdpp or not os.access(fsdpp, os.X_OK):
        return
    probe = subprocess.run([fsdpp, "probe"], capture_output=True, text=True, check=True)
    for line in probe.stdout.splitlines():
        name, _, value = line.partition("=")
        os.environ.setdefault(name, value)
