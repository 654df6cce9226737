#!/usr/bin/env python3
# Starting the benchmarks' rank processes and watching them: each rank's peak memory sampled
# while it runs (VmHWM from /proc/<pid>/status, or the GPU's memory in use through NVML), the
# others stopped as soon as one fails, and the line of a failed rank's log that says why.
import os
import signal
import socket
import subprocess
import time

from bench_common import BenchError

SAMPLE_S = 0.05


def vm_hwm_mib(pid):
    """Peak resident set of `pid` so far, or None once it has exited."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return None  # a zombie's status has no VmHWM line


def children(pid):
    found = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                found += [int(c) for c in f.read().split()]
        except OSError:
            pass
    return found


def rank_of(pid):
    # Between the launcher's fork and exec the environment does not hold RANK yet, so a
    # miss here is retried on the next sample rather than remembered.
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = f.read().split(b"\0")
    except OSError:
        return None
    for entry in env:
        if entry.startswith(b"RANK="):
            return int(entry[5:])
    return None


class GpuMemory:
    """The GPU's memory in use above the level before a run, in MiB, read through NVML."""

    def __init__(self):
        try:
            import pynvml
        except ImportError:
            raise BenchError("--device cuda samples GPU memory through pynvml (nvidia-ml-py)")
        pynvml.nvmlInit()
        self.nvml = pynvml
        self.handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        self.name = pynvml.nvmlDeviceGetName(self.handle)
        self.baseline = self.used()

    def used(self):
        return self.nvml.nvmlDeviceGetMemoryInfo(self.handle).used / 2**20

    def above_baseline(self):
        return self.used() - self.baseline


def supervise(name, procs, find_ranks, log_paths, world, gpu=None):
    """Waits for `procs`, sampling each rank's VmHWM (or, with `gpu`, the device's memory in
    use, counted as rank 0's); returns the peak MiB per rank.

    `find_ranks` maps the ranks found so far to their pids. When one process fails the
    rest are stopped, since a surviving rank would wait in a collective forever.
    """
    ranks, peaks = {}, {}
    while True:
        if gpu is not None:
            peaks[0] = max(peaks.get(0, 0.0), gpu.above_baseline())
        elif len(ranks) < world:
            ranks.update(find_ranks())
        for rank, pid in ranks.items():
            mib = vm_hwm_mib(pid)
            if mib is not None:
                peaks[rank] = max(peaks.get(rank, 0.0), mib)
        codes = [p.poll() for p in procs]
        failed = [(p, c) for p, c in zip(procs, codes) if c not in (None, 0)]
        if failed:
            for p in procs:
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
            for p in procs:
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
            proc, code = failed[0]
            log = log_paths[procs.index(proc)]
            raise BenchError(f"{name} exited with status {code}: {telling_line(log)} (log: {log})")
        if all(c == 0 for c in codes):
            break
        time.sleep(SAMPLE_S)
    if len(peaks) < (1 if gpu is not None else world):
        raise BenchError(f"{name}: ranks exited before their memory could be sampled")
    return peaks


def telling_line(path):
    # fsdpp's launcher ends with its own summary, so a rank's "error:" line says more than
    # the last line; a Python worker's last line is its exception or its one-line error.
    try:
        with open(path, errors="replace") as f:
            lines = [line.strip() for line in f if line.strip()]
    except OSError:
        return "no output"
    errors = [line for line in lines if " error: " in line]
    return errors[0] if errors else lines[-1] if lines else "no output"


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(cmd, log_path, env=None):
    log = open(log_path, "wb")
    try:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    except OSError as e:
        raise BenchError(f"cannot start {cmd[0]}: {e.strerror}")
    finally:
        log.close()  # the child holds its own copy
