#!/usr/bin/env python3
# Benchmarks fsdpp's sharded training against PyTorch's own FSDP2
# (torch.distributed.fsdp.fully_shard) on the same model, initial weights, batches, optimiser
# and thread count, and prints median step time, throughput, peak memory and the ratios.
# On the CPU (default: world 2 over gloo) memory is each rank's peak RSS; on a GPU
# (--device cuda: world 1 over NCCL, --param-dtype bfloat16 for mixed precision) it is the
# device's peak memory in use, and the model FLOPs utilisation is printed too. With
# --lora-rank R both engines train LoRA adapters from one PEFT adapter (fsdpp through
# [model] adapter, the peer through peft) with the base frozen.
# Run with the project venv from the repository root: .venv/bin/python scripts/bench_fsdp.py
#
# Peak RSS is read as VmHWM from /proc/<pid>/status of every rank process, sampled from
# this process while the ranks run: fsdpp's ranks are grandchildren under its launcher, so
# the rusage of a direct child would not reach them. GPU memory is the device's used memory
# (NVML) above what was in use before the run, sampled the same way: the engines run one
# after the other on an otherwise idle GPU. Both engines write a metrics.jsonl read by one
# function.
import argparse
import json
import math
import os
import shutil
import statistics
import sys
import tempfile

import profile_summary
from bench_common import (LOSS_TOLERANCE, BenchError, check_trained_alike, get, read_step_records,
                          routed_experts, run_main, write_initial_model)
from fsdp_peer import load_config, torch_worker, write_initial_adapter
from rank_processes import GpuMemory, children, free_port, rank_of, start, supervise

WARMUP_STEPS = 5  # steps left out of the step-time median (allocation, thread start-up)
HALF_LOSS_TOLERANCE = 2e-2  # bf16 or fp16 compute: the engines' kernels round differently
FP8_LOSS_TOLERANCE = 1e-2  # float8 products against fsdpp's own bf16, same weights and batches


# ---------------------------------------------------------------- measurement


def summarise(path, tokens_per_step, warmup_steps):
    records = read_step_records(path)
    if [r["step"] for r in records] != list(range(1, len(records) + 1)):
        raise BenchError(f"{path}: steps are not logged one by one from step 1")
    timed = [b["elapsed_s"] - a["elapsed_s"]
             for a, b in zip(records, records[1:]) if b["step"] > warmup_steps]
    if not timed:
        raise BenchError(f"{path}: no steps after the first {warmup_steps} to time")
    step_s = statistics.median(timed)
    return {"step_s": step_s, "tokens_per_s": tokens_per_step / step_s,
            "losses": [r["loss"] for r in records], "first_loss": records[0]["loss"],
            "final_loss": records[-1]["loss"], "first_grad_norm": records[0]["grad_norm"]}


def run_fsdpp(args, tmp, gpu, variant=""):
    """fsdpp's run; `variant` "fp8": its layers' products in float8; "in-step": offloaded
    masters updated before each step returns, where by default a host thread updates them
    while the next forward begins."""
    name = f"fsdpp-{variant}" if variant else "fsdpp"
    out_dir = os.path.join(tmp, name)
    log = os.path.join(tmp, f"{name}.log")
    sets = [f"train.steps={args.steps}", f"train.threads={args.threads}",
            f'parallel.device="{args.device}"',
            f"train.out_dir={json.dumps(out_dir)}",  # a JSON string is a valid TOML string
            f"model.path={json.dumps(args.init_dir)}", "data.shuffle=false",
            "checkpoint.save_final=false", "train.eval_every=0", 'metrics.progress="never"']
    if args.param_dtype:
        sets.append(f'policy.options.param_dtype="{args.param_dtype}"')
    if args.activation_checkpoint:
        sets.append("policy.options.activation_checkpoint=true")
    if args.offload:
        sets.append('policy.options.offload="cpu"')
    if variant == "fp8":
        sets.append('policy.options.compute="fp8"')
    if variant == "in-step":
        sets.append('optimizer.host_update="in_step"')
    if args.profile_step:
        sets.append(f"metrics.profile_step={args.profile_step}")
    if args.count_step:
        sets.append(f"metrics.count_step={args.count_step}")
    sets += [f"data.{key}={value}" for key, value in (("seq_len", args.seq_len), ("batch_size", args.batch_size))
             if value is not None]
    if args.lora_rank:
        sets.append(f"model.adapter={json.dumps(args.adapter_dir)}")  # the adapter's config declares the LoRA
    cmd = [args.fsdpp, "launch", "--nproc-per-node", str(args.world), "--", "train", args.config]
    for s in sets:
        cmd += ["--set", s]
    launcher = start(cmd, log)

    def find_ranks():
        found = {}
        for pid in children(launcher.pid):
            rank = rank_of(pid)
            if rank is not None:
                found[rank] = pid
        return found

    peaks = supervise("fsdpp", [launcher], find_ranks, [log], args.world, gpu)
    return out_dir, peaks


def run_torch(args, tmp, gpu, compiled=False):
    out_dir = os.path.join(tmp, "pytorch-compiled" if compiled else "pytorch")
    port = free_port()
    procs, logs = [], []
    for rank in range(args.world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(args.world), LOCAL_RANK=str(rank),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        logs.append(os.path.join(out_dir + f"-rank{rank}.log"))
        cmd = [sys.executable, os.path.abspath(__file__), "--torch-worker", "--config", args.config,
               "--steps", str(args.steps), "--threads", str(args.threads), "--out-dir", out_dir,
               "--init-dir", args.init_dir, "--device", args.device]
        if args.param_dtype:
            cmd += ["--param-dtype", args.param_dtype]
        cmd += ["--activation-checkpoint"] * args.activation_checkpoint + ["--offload"] * args.offload
        # Kernels torch.compile generates are no ATen operators: the compiled peer is not counted.
        cmd += ["--profile-step", str(args.profile_step), "--count-step", str(0 if compiled else args.count_step)]
        cmd += ["--compile"] * compiled
        for flag, value in (("--seq-len", args.seq_len), ("--batch-size", args.batch_size)):
            if value is not None:
                cmd += [flag, str(value)]
        if args.lora_rank:
            cmd += ["--lora-rank", str(args.lora_rank), "--adapter-dir", args.adapter_dir]
        procs.append(start(cmd, logs[-1], env))
    peaks = supervise("pytorch fully_shard" + " compiled" * compiled, procs,
                      lambda: {r: p.pid for r, p in enumerate(procs)}, logs, args.world, gpu)
    return out_dir, peaks


def read_op_counts(out_dir, step):
    """Rank 0's count of `step` (engine/metrics/op_count.h), as both engines write it."""
    path = os.path.join(out_dir, f"ops-step-{step}-rank-0.json")
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise BenchError(f"cannot read the operator count {path}: {e}")


def print_fp8_trajectory(bf16, fp8):
    """Where the float8 run's losses part from bf16's: step 1 (the same weights, so its loss
    and gradient norm differ by the products' rounding alone), then the losses at a few steps
    and the mean of the last ten, which a single batch's loss does not smooth."""
    print(f"step-1 loss: bf16 {bf16['first_loss']:.6f}, fp8 {fp8['first_loss']:.6f}; grad norm: bf16 "
          f"{bf16['first_grad_norm']:.6f}, fp8 {fp8['first_grad_norm']:.6f}")
    steps = len(bf16["losses"])
    shown = sorted({s for s in (2, 5, 10, 15, 25, 50, 100, 200, steps) if s <= steps})
    print("losses (step: bf16 / fp8): " + ", ".join(
        f"{s}: {bf16['losses'][s - 1]:.4f} / {fp8['losses'][s - 1]:.4f}" for s in shown))
    tail = min(10, steps)
    a, b = (sum(r["losses"][-tail:]) / tail for r in (bf16, fp8))
    print(f"mean of the last {tail} steps' losses: bf16 {a:.4f}, fp8 {b:.4f} ({abs(b - a) / a:.2e} relative)")


def print_op_counts(results, step):
    """The counted step's kernels and the bytes of the kernels other than products and
    attention, per engine and (with the peer) as fsdpp's ratio, then fsdpp's operators by bytes."""
    print(f"\nstep {step}, rank 0: {'kernels':>9}{'products':>10}{'attention':>11}{'other':>8}{'other MiB':>11}")
    for name in ("fsdpp", "pytorch"):
        if name not in results:
            continue
        c = results[name]["ops"]
        print(f"{name:<17}{c['kernels']:>9}{c['matmul_kernels']:>10}{c['attention_kernels']:>11}"
              f"{c['other_kernels']:>8}{c['other_bytes'] / 2**20:>11.1f}")
    f = results["fsdpp"]["ops"]
    if "pytorch" in results:
        p = results["pytorch"]["ops"]
        print(f"kernel ratio (fsdpp / pytorch fully_shard): {f['kernels'] / p['kernels']:.2f}x; other bytes ratio "
              f"{f['other_bytes'] / max(p['other_bytes'], 1):.2f}x")
    top = sorted(f["ops"].items(), key=lambda kv: -kv[1]["bytes"])[:12]
    print("fsdpp's operators by bytes: " + ", ".join(
        f"{name.split('::')[-1]} {v['calls']}x {v['bytes'] / 2**20:.1f} MiB" for name, v in top))


def idle_expert_parameters(hf_config):
    """The routed-expert weights a token does not pass through: in each MoE layer, those of
    the experts beyond its num_experts_per_tok (Qwen3-MoE's and DeepSeek-V3's layouts)."""
    experts = routed_experts(hf_config)
    if not experts:
        return 0
    layers = range(hf_config.num_hidden_layers)
    if hasattr(hf_config, "first_k_dense_replace"):
        moe_layers = [i for i in layers if i >= hf_config.first_k_dense_replace]
    else:
        moe_layers = [i for i in layers if i not in (hf_config.mlp_only_layers or [])
                      and (i + 1) % hf_config.decoder_sparse_step == 0]
    per_expert = 3 * hf_config.hidden_size * hf_config.moe_intermediate_size
    return len(moe_layers) * per_expert * (experts - hf_config.num_experts_per_tok)


def flops_per_token(n_params, hf_config, seq_len, frozen=0):
    """Training FLOPs per token, as the engine counts them for its MFU: 6 per weight of every
    matrix product the token passes through (forward and backward; a MoE layer's routed
    experts only as many as it is routed to) plus attention's score and value products,
    6 x layers x heads x sequence length x (query/key head size + value head size). The input
    embedding is a lookup; tied to the output head it is a product too. `frozen` of the
    `n_params` weights (a LoRA base) take 4 each, forward and their input's gradient: the
    weights count 6 less 2 for the frozen share of them."""
    embedding = 0 if hf_config.tie_word_embeddings else hf_config.vocab_size * hf_config.hidden_size
    if getattr(hf_config, "kv_lora_rank", None):  # latent attention (DeepSeek-V3)
        qk_head = hf_config.qk_nope_head_dim + hf_config.qk_rope_head_dim
        v_head = hf_config.v_head_dim
    else:
        qk_head = v_head = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    attention = 6 * hf_config.num_hidden_layers * hf_config.num_attention_heads * seq_len * (qk_head + v_head)
    per_weight = 6 - 2 * frozen / max(n_params, 1)
    return per_weight * (n_params - embedding - idle_expert_parameters(hf_config)) + attention


# The peers by their results' names, as the output names them.
TITLES = {"pytorch": "pytorch fully_shard", "compiled": "fully_shard + compiled layers"}


def adapter_parameters(adapter_dir):
    """The weights of the PEFT adapter in `adapter_dir`, which a LoRA run trains alone."""
    from safetensors import safe_open
    with safe_open(os.path.join(adapter_dir, "adapter_model.safetensors"), "pt") as f:
        return sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())


def bench(args):
    if not (os.path.isfile(args.fsdpp) and os.access(args.fsdpp, os.X_OK)):
        raise BenchError(f"fsdpp binary {args.fsdpp} not found or not executable; build it first "
                         "or pass --fsdpp")
    if args.steps <= args.warmup_steps + 1:
        raise BenchError(f"--steps must be greater than {args.warmup_steps + 1}")
    for flag, step in (("--profile-step", args.profile_step), ("--count-step", args.count_step)):
        if not 0 <= step <= args.steps:
            raise BenchError(f"{flag} must be within the {args.steps} steps (0: none)")
    for flag, value in (("--seq-len", args.seq_len), ("--batch-size", args.batch_size)):
        if value is not None and value < 1:
            raise BenchError(f"{flag} must be at least 1")
    if args.threads < 1:
        raise BenchError("--threads must be at least 1")
    if args.world is None:
        args.world = 1 if args.device == "cuda" else 2
    if args.device == "cuda" and args.world != 1:
        raise BenchError("--device cuda runs one rank on the one GPU (--world 1)")
    if args.fp8 and args.device != "cuda":
        raise BenchError("--fp8 needs --device cuda: float8 products run on GPUs of compute capability 9.0+")
    cfg = load_config(args.config, args.steps, args.seq_len, args.batch_size)
    # The run file's compute dtype, for the peer as for fsdpp, unless the command line says.
    args.param_dtype = args.param_dtype or cfg.get("policy", {}).get("options", {}).get("param_dtype")
    data = get(cfg, "data.train")
    if not os.path.isfile(data):
        raise BenchError(f"token file {data} not found (scripts/make_corpus.sh builds the default)")
    seq_len = int(get(cfg, "data.seq_len"))
    tokens_per_step = int(get(cfg, "data.batch_size")) * seq_len * int(get(cfg, "train.grad_accum", 1))
    gpu = GpuMemory() if args.device == "cuda" else None
    memory = "GPU MiB" if gpu else "RSS MiB"

    tmp = tempfile.mkdtemp(prefix="fsdpp-bench-fsdp-")  # kept on failure for its logs
    args.init_dir, n_params, hf_config = write_initial_model(cfg, os.path.join(tmp, "initial-model"), args.layers)
    if args.lora_rank:
        args.adapter_dir = write_initial_adapter(args.init_dir, args.lora_rank, args.lora_targets.split(","),
                                                 os.path.join(tmp, "initial-adapter"))
    results = {}
    engines = [("fsdpp", run_fsdpp)] + ([] if args.no_peer else [("pytorch", run_torch)])
    if args.fp8:
        engines.insert(1, ("fsdpp-fp8", lambda a, t, g: run_fsdpp(a, t, g, "fp8")))
    if args.offload and args.device == "cuda":  # a CPU run updates in the step anyway
        engines.insert(1, ("fsdpp-in-step", lambda a, t, g: run_fsdpp(a, t, g, "in-step")))
    if args.compile and not args.no_peer:
        engines.append(("compiled", lambda a, t, g: run_torch(a, t, g, compiled=True)))
    for name, run in engines:
        print(f"running {name} at world {args.world} on {gpu.name if gpu else 'the CPU'} ({args.steps} steps, "
              f"{args.threads} thread(s) per rank, compute in {args.param_dtype or get(cfg, 'model.dtype', 'float32')}"
              f"{f', LoRA rank {args.lora_rank}' if args.lora_rank else ', every parameter trained'})...", flush=True)
        out_dir, peaks = run(args, tmp, gpu)
        results[name] = summarise(os.path.join(out_dir, "metrics.jsonl"), tokens_per_step, args.warmup_steps)
        results[name]["memory"] = peaks
        if args.profile_step:
            trace = os.path.join(out_dir, f"profile-step-{args.profile_step}-rank-0.json")
            if not os.path.isfile(trace):
                raise BenchError(f"{name} wrote no trace {trace}")
            print(f"{name}, step {args.profile_step}: " + "\n".join(profile_summary.summarise(trace)), flush=True)
            if args.trace_dir:
                os.makedirs(args.trace_dir, exist_ok=True)
                shutil.copy(trace, os.path.join(args.trace_dir, f"{name}-step-{args.profile_step}.json"))
        if args.count_step and name != "compiled":
            results[name]["ops"] = read_op_counts(out_dir, args.count_step)
    shutil.rmtree(tmp, ignore_errors=True)

    ranks = sorted(results["fsdpp"]["memory"])
    print()
    print(f"{'engine':<15}{'step s':>10}{'tokens/s':>11}" + "".join(f"{f'{memory} r{r}':>14}" for r in ranks)
          + f"{'first loss':>12}{'final loss':>12}")
    for name, r in results.items():
        print(f"{name:<15}{r['step_s']:>10.4f}{r['tokens_per_s']:>11.1f}"
              + "".join(f"{r['memory'][k]:>14.1f}" for k in ranks)
              + f"{r['first_loss']:>12.4f}{r['final_loss']:>12.4f}")
    f = results["fsdpp"]
    print()
    for peer, title in TITLES.items():
        if peer not in results:
            continue
        p = results[peer]
        print(f"step time ratio (fsdpp / {title}): {f['step_s'] / p['step_s']:.2f}x; tokens/s ratio "
              f"{f['tokens_per_s'] / p['tokens_per_s']:.2f}x")
        for rank in ranks:
            print(f"peak {memory.split()[0]} ratio rank {rank} (fsdpp / {title}): "
                  f"{f['memory'][rank] / p['memory'][rank]:.2f}x")
    if args.fp8:
        e = results["fsdpp-fp8"]
        print(f"tokens/s ratio (fsdpp fp8 / fsdpp bf16): {e['tokens_per_s'] / f['tokens_per_s']:.2f}x; "
              f"step time ratio {e['step_s'] / f['step_s']:.2f}x")
    if "fsdpp-in-step" in results:
        e = results["fsdpp-in-step"]
        print(f"tokens/s ratio (fsdpp, host updates overlapped with the next forward / in the step): "
              f"{f['tokens_per_s'] / e['tokens_per_s']:.2f}x")
    if args.count_step:
        print_op_counts(results, args.count_step)
    if gpu:
        adapters = adapter_parameters(args.adapter_dir) if args.lora_rank else 0
        flops = flops_per_token(n_params + adapters, hf_config, seq_len, frozen=n_params if adapters else 0)
        for name, r in results.items():
            mfu = r["tokens_per_s"] * flops / (args.peak_tflops * 1e12 * args.world)
            print(f"MFU {name}: {100 * mfu:.1f}% ({n_params / 1e6:.0f}M parameters, {flops / 1e9:.2f} GFLOP per "
                  f"token, peak {args.peak_tflops:g} TFLOP/s)")
    # Same weights, data and optimiser: the curves must agree, or the timings compare
    # different work.
    def norm(value):  # null where float16 gradients overflowed and the step was skipped
        return "skipped" if value is None else f"{value:.6f}"
    if "pytorch" in results:
        t = results["pytorch"]
        print(f"step-1 loss: fsdpp {f['first_loss']:.6f}, pytorch fully_shard {t['first_loss']:.6f}; "
              f"grad norm: fsdpp {norm(f['first_grad_norm'])}, pytorch fully_shard {norm(t['first_grad_norm'])}")
    if "fsdpp-in-step" in results and f["losses"] != results["fsdpp-in-step"]["losses"]:
        raise BenchError("fsdpp's losses with host updates overlapped differ from those updated in the step: "
                         f"{f['losses']} vs {results['fsdpp-in-step']['losses']}")
    if args.fp8:
        print("fsdpp fp8 against fsdpp bf16:")
        print_fp8_trajectory(f, results["fsdpp-fp8"])
        check_trained_alike(f["losses"], results["fsdpp-fp8"]["losses"], FP8_LOSS_TOLERANCE,
                            moe=routed_experts(hf_config) > 0, peer="fsdpp fp8")
    for peer in ("pytorch", "compiled"):
        if peer in results:
            check_trained_alike(f["losses"], results[peer]["losses"],
                                HALF_LOSS_TOLERANCE if args.param_dtype in ("bfloat16", "float16") else LOSS_TOLERANCE,
                                moe=routed_experts(hf_config) > 0, peer=TITLES.get(peer, peer))


if __name__ == "__main__":
    run_main("bench_fsdp",
             "Train the same model with fsdpp (fsdpp launch) and with PyTorch's fully_shard (FSDP2), "
             "from the same initial weights and batches, then compare median step time, tokens/s, "
             "peak memory and loss: on the CPU over gloo (default: 2 ranks) or on one GPU over NCCL. "
             "Relative paths, including those inside the config, resolve against the current directory.",
             steps=40, threads=1, warmup_steps=WARMUP_STEPS, bench=bench, torch_worker=torch_worker,
             extra_args=[
                 ("--device", {"choices": ["cpu", "cuda"], "default": "cpu",
                               "help": "where both engines compute (default: %(default)s)"}),
                 ("--world", {"type": int, "help": "ranks per engine (default: 2 on the CPU, 1 on a GPU)"}),
                 ("--param-dtype", {"choices": ["bfloat16", "float16", "float32"],
                                    "help": "compute dtype over fp32 masters, fp32 reductions (default: the run "
                                            "file's policy option, else the model's)"}),
                 ("--activation-checkpoint", {"action": "store_true",
                                              "help": "both engines recompute each decoder layer in backward"}),
                 ("--offload", {"action": "store_true",
                                "help": "both engines keep fp32 masters, gradients and optimizer state on the host; "
                                        "on a GPU fsdpp runs twice, its host updates overlapped with the next "
                                        "forward and in the step"}),
                 ("--profile-step", {"type": int, "default": 0,
                                     "help": "trace this step in both engines and summarise where its GPU time went"}),
                 ("--trace-dir", {"help": "keep the --profile-step traces here as ENGINE-step-N.json"}),
                 ("--count-step", {"type": int, "default": 0,
                                   "help": "count this step's kernels and the bytes the ones other than matrix "
                                           "products and attention move, in both engines (any device)"}),
                 ("--layers", {"type": int,
                               "help": "keep the model's first N decoder layers (its widths at a depth a CPU "
                                       "runs; default: all)"}),
                 ("--seq-len", {"type": int, "help": "tokens per row (default: the run file's)"}),
                 ("--batch-size", {"type": int, "help": "rows per step (default: the run file's)"}),
                 ("--peak-tflops", {"type": float, "default": 989.0,
                                    "help": "the GPU's dense bf16 peak for MFU (default: %(default)s, H100/H200 SXM)"}),
                 ("--lora-rank", {"type": int, "default": 0,
                                  "help": "train LoRA adapters of this rank on the attention projections, the base "
                                          "frozen: fsdpp from a PEFT adapter, the peer with peft (default: full "
                                          "fine-tuning)"}),
                 ("--lora-targets", {"default": "q_proj,k_proj,v_proj,o_proj",
                                     "help": "comma-separated modules the adapters go on (default: %(default)s)"}),
                 ("--compile", {"action": "store_true",
                                "help": "also run the peer with each decoder layer torch.compile'd before "
                                        "fully_shard (torchtitan's recipe)"}),
                 ("--fp8", {"action": "store_true",
                            "help": "also run fsdpp with its layers' linear products in float8 "
                                    "(policy option compute = \"fp8\"; bf16 compute, a GPU of compute "
                                    "capability 9.0+) and compare it with fsdpp's bf16 run"}),
                 ("--no-peer", {"action": "store_true",
                                "help": "run fsdpp alone (with --fp8, its bf16 and float8 runs), no PyTorch"}),
                 ("--adapter-dir", {"help": argparse.SUPPRESS}),
             ])
