#!/usr/bin/env python3
"""Where one profiled training step spent its GPU time, from a Chrome trace written by
fsdpp ([metrics] profile_step) or by torch.profiler: device time by kind of kernel (matrix
products, attention, collectives, optimizer, the gradient norm, normalisation, the fused SwiGLU and RoPE
kernels, loss, copies, other elementwise), the time the GPU sat idle inside the step, and
the costliest kernels.
Usage: profile_summary.py TRACE.json [--top N]"""
import argparse
import json
import re
import sys
from collections import defaultdict

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
# First match wins: attention before matmul (its kernels contain "gemm"-like words too).
KINDS = [
    ("collectives", re.compile(r"nccl", re.I)),
    ("attention", re.compile(r"flash|fmha|attention|sdpa", re.I)),
    ("matmul", re.compile(r"gemm|nvjet|xmma|cutlass|cublas|splitk", re.I)),
    ("optimizer", re.compile(r"adam", re.I)),
    # The global gradient norm: _foreach_norm's LpNorm kernels, a vector norm's reduction.
    ("gradient norm", re.compile(r"lpnorm|NormOps|norm_cleanup", re.I)),
    ("normalisation", re.compile(r"rms|norm", re.I)),
    ("SwiGLU, RoPE (fused)", re.compile(r"swiglu|rotary", re.I)),
    ("loss", re.compile(r"softmax|nll_loss|cross_entropy", re.I)),
    # "cat" as a word's start (CatArrayBatchedCopy, cat_kernel), not inside scatter.
    ("copies, casts, fills", re.compile(r"memcpy|memset|copy|fill|(?<![a-z])cat", re.I)),
]


def kind_of(name):
    for kind, pattern in KINDS:
        if pattern.search(name):
            return kind
    return "other elementwise, reductions"


def union_length(intervals):
    total, end = 0.0, float("-inf")
    for b, e in sorted(intervals):
        if e <= end:
            continue
        total += e - max(b, end)
        end = e
    return total


def summarise(path, top=12):
    """Returns the summary's lines for the trace at `path`."""
    try:
        with open(path) as f:
            trace = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise SystemExit(f"profile_summary: cannot read {path}: {e}")
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    gpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in GPU_CATEGORIES and "dur" in e]
    if not gpu:
        return [f"{path}: no GPU activity recorded"]
    begin = min(e["ts"] for e in gpu)
    span = max(e["ts"] + e["dur"] for e in gpu) - begin
    busy = union_length([(e["ts"], e["ts"] + e["dur"]) for e in gpu])
    by_kind, by_name = defaultdict(float), defaultdict(lambda: [0.0, 0])
    for e in gpu:
        by_kind[kind_of(e["name"])] += e["dur"]
        by_name[e["name"]][0] += e["dur"]
        by_name[e["name"]][1] += 1
    lines = [f"GPU time of the step ({len(gpu)} kernels and copies, {span / 1e3:.1f} ms from the first to the last):"]
    for kind, us in sorted(by_kind.items(), key=lambda kv: -kv[1]):
        lines.append(f"  {kind:<32}{us / 1e3:>9.2f} ms {100 * us / span:>6.1f}%")
    lines.append(f"  {'GPU idle inside the step':<32}{(span - busy) / 1e3:>9.2f} ms {100 * (span - busy) / span:>6.1f}%")
    lines.append(f"costliest kernels (of {len(by_name)}):")
    for name, (us, count) in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"  {us / 1e3:>8.2f} ms {count:>5}x  {name[:110]}")
    return lines


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace")
    ap.add_argument("--top", type=int, default=12)
    args = ap.parse_args()
    print("\n".join(summarise(args.trace, args.top)))


if __name__ == "__main__":
    sys.exit(main())
