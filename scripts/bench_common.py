"""Shared by the benchmark scripts: errors, config look-ups, metrics records, the token-file
reader and fsdpp's learning-rate schedule, so every peer is fed and measured the same way."""
import argparse
import json
import math
import os
import sys
import tomllib

import cpu_cap

TOKEN_MAGIC = b"FSDPTOK\x00"
TOKEN_HEADER_BYTES = 32
SMOKE_STEPS = 3  # one untimed, two timed
SMOKE_WARMUP_STEPS = 1
# fp32 with the same weights and batches, only the order of sums differing: the gap grows with
# the steps and with how the CPU's threads split them (bench_train's 60 steps ended 6.9e-5
# apart at two threads, 1.8e-4 at one), a diverging engine's by orders of magnitude more.
LOSS_TOLERANCE = 1e-3
# A MoE router's top-k choice flips on rounding-level differences between the engines, after
# which each trains on its own (equally good) path: the first steps, before any flip, must
# agree as closely as a dense model's, the final losses only as two runs of one recipe do.
MOE_EARLY_STEPS, MOE_LOSS_TOLERANCE = 3, 2e-2


class BenchError(Exception):
    pass


def routed_experts(hf_config):
    """A MoE layer's routed experts (Qwen3-MoE's num_experts, DeepSeek-V3's n_routed_experts);
    0 for a dense model."""
    return getattr(hf_config, "num_experts", None) or getattr(hf_config, "n_routed_experts", None) or 0


def experts_kernel(init_dir, element_bytes):
    """from_pretrained's arguments for the experts of the MoE model in `init_dir`, computed in
    elements of `element_bytes`: transformers' default grouped product refuses expert matrices
    whose rows are not 16-byte multiples, so those take one product per expert ("eager"), as
    fsdpp does (engine/models/moe.h). Nothing for a dense model or aligned rows."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(init_dir)
    widths = (config.hidden_size, getattr(config, "moe_intermediate_size", 0) or 0)
    if not routed_experts(config) or all(w * element_bytes % 16 == 0 for w in widths):
        return {}
    return {"experts_implementation": "eager"}


def fail(prog, msg):
    print(f"{prog}: {msg}", file=sys.stderr)
    sys.exit(2)


def get(cfg, dotted, default=None):
    node = cfg
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            if default is None:
                raise BenchError(f"config has no {dotted}")
            return default
        node = node[part]
    return node


def read_toml(path):
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as e:
        raise BenchError(f"cannot read config {path}: {e.strerror}")
    except tomllib.TOMLDecodeError as e:
        raise BenchError(f"{path}: {e}")


def read_step_records(path):
    """Training-step records of a metrics.jsonl (evaluation records carry no timing)."""
    steps = []
    try:
        with open(path) as f:
            for line in f:
                rec = json.loads(line)
                if "elapsed_s" in rec:
                    steps.append(rec)
    except OSError as e:
        raise BenchError(f"cannot read metrics {path}: {e.strerror}")
    except json.JSONDecodeError as e:
        raise BenchError(f"{path}: bad JSON line ({e.msg})")
    return steps


def read_tokens(path):
    import numpy as np

    try:
        with open(path, "rb") as f:
            header = f.read(TOKEN_HEADER_BYTES)
    except OSError as e:
        raise BenchError(f"cannot read {path}: {e.strerror}")
    if len(header) < TOKEN_HEADER_BYTES or header[:8] != TOKEN_MAGIC:
        raise BenchError(f"{path} is not an fsdpp token file")
    version, width, count, vocab = (int.from_bytes(header[o:o + n], "little")
                                    for o, n in ((8, 4), (12, 4), (16, 8), (24, 8)))
    if version != 1 or width not in (2, 4):
        raise BenchError(f"{path}: unsupported token file (version {version}, width {width})")
    if os.path.getsize(path) < TOKEN_HEADER_BYTES + count * width:
        raise BenchError(f"{path} is truncated")
    dtype = "<u2" if width == 2 else "<u4"
    return np.memmap(path, dtype=dtype, mode="r", offset=TOKEN_HEADER_BYTES, shape=(count,)), vocab


def lr_at(step, cfg):
    # Mirrors fsdpp's schedule: `step` counts from 1 and warm-up includes its last step.
    peak = float(get(cfg, "optimizer.lr"))
    kind = get(cfg, "scheduler.kind", "cosine")
    warmup = int(get(cfg, "scheduler.warmup_steps", 0))
    if step <= warmup:
        return peak * step / warmup
    if kind == "constant":
        return peak
    if kind not in ("cosine", "linear"):
        raise BenchError(f"unsupported scheduler.kind {kind!r}")
    total = int(get(cfg, "train.steps"))
    min_lr = peak * float(get(cfg, "scheduler.min_lr_ratio", 0.0))
    progress = min(1.0, (step - warmup - 1) / max(1, total - warmup))
    shape = 0.5 * (1 + math.cos(math.pi * progress)) if kind == "cosine" else 1 - progress
    return min_lr + (peak - min_lr) * shape


def write_initial_model(cfg, out_dir, layers=None):
    """Saves the config's model, freshly initialised by transformers, as an HF directory;
    returns the directory, the count of distinct parameters and the HF config. `layers`
    keeps the first that many decoder layers of the config (a real model's widths at a depth
    a CPU runs).

    Both engines then start from these weights, so their losses agree from the first step
    and any gap in the curves is the engines', not their initialisers'.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    path = get(cfg, "model.path")
    try:
        hf_config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise BenchError(f"cannot load model config {path}: {str(e).splitlines()[0]}")
    if layers is not None:
        if not 1 <= layers <= hf_config.num_hidden_layers:
            raise BenchError(f"--layers {layers}: {path} has {hf_config.num_hidden_layers} layers")
        hf_config.num_hidden_layers = layers
        if getattr(hf_config, "layer_types", None):  # one entry per layer (transformers 5)
            hf_config.layer_types = hf_config.layer_types[:layers]
    torch.manual_seed(int(get(cfg, "model.init_seed", 0)))
    model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    model.save_pretrained(out_dir)  # safetensors by default
    return out_dir, sum(p.numel() for p in model.parameters()), hf_config


class WindowSampler:
    """Windows of seq_len + 1 tokens starting every seq_len tokens, in file order, as fsdpp
    visits them with data.shuffle = false (the engines shuffle with different generators, and
    the same batches are what makes their losses comparable step by step).

    Every rank draws the same global batch and keeps its own rows, as fsdpp does.
    """

    def __init__(self, tokens, seq_len):
        import numpy as np

        self.np = np
        self.tokens, self.seq_len = tokens, seq_len
        self.windows = (len(tokens) - 1) // seq_len
        if self.windows < 1:
            raise BenchError(f"training split has {len(tokens)} tokens, fewer than seq_len + 1")
        self.cursor = 0

    def take(self, count):
        rows = []
        for _ in range(count):
            if self.cursor == self.windows:
                self.cursor = 0
            start = self.cursor * self.seq_len
            rows.append(self.tokens[start:start + self.seq_len + 1])
            self.cursor += 1
        return self.np.stack(rows).astype(self.np.int64)


def check_trained_alike(fsdpp_losses, peer_losses, tolerance, moe, peer="the peer"):
    """The engines ran the same weights, batches and optimiser: their final losses (the last
    of each step's losses given) must agree within `tolerance` (relative), or the timings
    compare different work; `peer` names the other engine in what is printed. A MoE model's first MOE_EARLY_STEPS losses must, and its final
    ones within MOE_LOSS_TOLERANCE, since a routing flip later sends each on its own path."""
    if moe:
        early = list(zip(fsdpp_losses, peer_losses))[:MOE_EARLY_STEPS]
        gap = max(abs(a - b) / abs(b) for a, b in early)
        print(f"first {len(early)} steps' losses, fsdpp against {peer}, largest relative difference: {gap:.2e}")
        if gap > tolerance:
            raise BenchError(f"the engines' first losses differ by {gap:.2e} relative (more than {tolerance:g})")
        tolerance = MOE_LOSS_TOLERANCE
    gap = abs(fsdpp_losses[-1] - peer_losses[-1]) / abs(peer_losses[-1])
    print(f"final loss relative difference, fsdpp against {peer}: {gap:.2e}")
    if gap > tolerance:
        raise BenchError(f"the engines' final losses differ by {gap:.2e} relative (more than "
                         f"{tolerance:g}), so they did not train alike")


def global_load_balancing_loss(router_logits, top_k):
    """This rank's share of transformers' load-balancing loss (Qwen3-MoE's aux_loss) over the
    micro-batch of every rank, as fsdpp computes it: E × Σ_e f_e P_e over every
    layer's router rows, f_e the share of routed slots expert e got, counted over all ranks,
    and P_e its summed router probability on this rank over all ranks' rows. The loss is linear
    in P, so the ranks' shares, and their gradients, add up to the whole batch's."""
    import torch
    import torch.distributed as dist

    probs = torch.cat([logits.float().softmax(-1) for logits in router_logits])  # [L × rows, E]
    experts = probs.shape[-1]
    chosen = probs.topk(top_k, -1).indices.flatten()
    counts = torch.zeros(experts, dtype=torch.float64, device=probs.device).index_add_(
        0, chosen, torch.ones(chosen.numel(), dtype=torch.float64, device=probs.device))  # no host sync
    rows = torch.tensor([float(probs.shape[0])], dtype=torch.float64, device=probs.device)
    dist.all_reduce(counts)
    dist.all_reduce(rows)
    return experts * (counts / rows * probs.sum(0).double() / rows).sum()


def parse_args(ap, smoke_defaults):
    """Parses the command line; under --smoke `smoke_defaults` replace the defaults, so that
    values given explicitly still win."""
    args = ap.parse_args()
    if args.smoke:
        ap.set_defaults(**smoke_defaults)
        args = ap.parse_args()
    return args


def run_main(prog, description, steps, threads, warmup_steps, bench, torch_worker, extra_args=()):
    """The command line both benchmarks share; --torch-worker re-enters as the peer's process.

    `bench` reads the untimed warm-up as args.warmup_steps: --smoke shortens it with the run,
    so that a smoke run still times steps and checks what a real one checks."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--config", default="examples/tiny-llama.toml",
                    help="fsdpp TOML config to benchmark (default: %(default)s)")
    ap.add_argument("--steps", type=int, default=steps,
                    help=f"optimiser steps per engine; the first {warmup_steps} are not timed "
                    "(default: %(default)s)")
    ap.add_argument("--smoke", action="store_true",
                    help=f"check the whole benchmark in seconds: {SMOKE_STEPS} steps unless --steps is given, "
                    f"{SMOKE_WARMUP_STEPS} of them untimed warm-up; its figures mean nothing")
    ap.add_argument("--threads", type=int, default=threads,
                    help="compute threads per process for both engines (default: %(default)s)")
    ap.add_argument("--fsdpp", default="build/fsdpp", help="path to the fsdpp binary (default: %(default)s)")
    for flag, kwargs in extra_args:
        ap.add_argument(flag, **kwargs)
    ap.add_argument("--torch-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out-dir", help=argparse.SUPPRESS)
    ap.add_argument("--init-dir", help=argparse.SUPPRESS)
    ap.error = lambda msg: fail(prog, msg)
    args = parse_args(ap, {"steps": SMOKE_STEPS})
    args.warmup_steps = SMOKE_WARMUP_STEPS if args.smoke else warmup_steps
    if not args.torch_worker:
        cpu_cap.apply(args.fsdpp)  # the peers, started from here, run the kernels fsdpp runs
    try:
        if args.torch_worker:
            if not args.out_dir:
                raise BenchError("--torch-worker needs --out-dir")
            torch_worker(args)
        else:
            bench(args)
    except BenchError as e:
        fail(prog, str(e))
