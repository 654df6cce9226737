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
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import profile_summary
from bench_common import (LOSS_TOLERANCE, BenchError, WindowSampler, check_trained_alike, get, read_toml, lr_at,
                          read_step_records, read_tokens, run_main, write_initial_model)

WARMUP_STEPS = 5  # steps left out of the step-time median (allocation, thread start-up)
SAMPLE_S = 0.05
BF16_LOSS_TOLERANCE = 2e-2  # bf16 compute: the engines' kernels round differently


# ---------------------------------------------------------------- configuration


def load_config(path, steps):
    cfg = read_toml(path)
    cfg.setdefault("train", {})["steps"] = steps
    # Windows in file order: the two engines shuffle with different generators, and the
    # same batches are what makes their losses comparable step by step.
    cfg.setdefault("data", {})["shuffle"] = False
    return cfg


# ---------------------------------------------------------------- process sampling


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
            "first_loss": records[0]["loss"], "final_loss": records[-1]["loss"],
            "first_grad_norm": records[0]["grad_norm"]}


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


def run_fsdpp(args, tmp, gpu):
    out_dir = os.path.join(tmp, "fsdpp")
    log = os.path.join(tmp, "fsdpp.log")
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
    if args.profile_step:
        sets.append(f"metrics.profile_step={args.profile_step}")
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


def run_torch(args, tmp, gpu):
    out_dir = os.path.join(tmp, "pytorch")
    port = free_port()
    procs, logs = [], []
    for rank in range(args.world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(args.world), LOCAL_RANK=str(rank),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        logs.append(os.path.join(tmp, f"pytorch-rank{rank}.log"))
        cmd = [sys.executable, os.path.abspath(__file__), "--torch-worker", "--config", args.config,
               "--steps", str(args.steps), "--threads", str(args.threads), "--out-dir", out_dir,
               "--init-dir", args.init_dir, "--device", args.device]
        if args.param_dtype:
            cmd += ["--param-dtype", args.param_dtype]
        cmd += ["--activation-checkpoint"] * args.activation_checkpoint + ["--offload"] * args.offload
        cmd += ["--profile-step", str(args.profile_step)]
        if args.lora_rank:
            cmd += ["--lora-rank", str(args.lora_rank), "--adapter-dir", args.adapter_dir]
        procs.append(start(cmd, logs[-1], env))
    peaks = supervise("pytorch fully_shard", procs,
                      lambda: {r: p.pid for r, p in enumerate(procs)}, logs, args.world, gpu)
    return out_dir, peaks


def idle_expert_parameters(hf_config):
    """The routed-expert weights a token does not pass through: in each MoE layer, those of
    the experts beyond its num_experts_per_tok (Qwen3-MoE's and DeepSeek-V3's layouts)."""
    experts = getattr(hf_config, "num_experts", None) or getattr(hf_config, "n_routed_experts", None)
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


def flops_per_token(n_params, hf_config, seq_len):
    """Training FLOPs per token, as the engine counts them for its MFU: 6 per weight of every
    matrix product the token passes through (forward and backward; a MoE layer's routed
    experts only as many as it is routed to) plus attention's score and value products,
    6 x layers x heads x sequence length x (query/key head size + value head size). The input
    embedding is a lookup; tied to the output head it is a product too."""
    embedding = 0 if hf_config.tie_word_embeddings else hf_config.vocab_size * hf_config.hidden_size
    if getattr(hf_config, "kv_lora_rank", None):  # latent attention (DeepSeek-V3)
        qk_head = hf_config.qk_nope_head_dim + hf_config.qk_rope_head_dim
        v_head = hf_config.v_head_dim
    else:
        qk_head = v_head = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    attention = 6 * hf_config.num_hidden_layers * hf_config.num_attention_heads * seq_len * (qk_head + v_head)
    return 6 * (n_params - embedding - idle_expert_parameters(hf_config)) + attention


def bench(args):
    if not (os.path.isfile(args.fsdpp) and os.access(args.fsdpp, os.X_OK)):
        raise BenchError(f"fsdpp binary {args.fsdpp} not found or not executable; build it first "
                         "or pass --fsdpp")
    if args.steps <= args.warmup_steps + 1:
        raise BenchError(f"--steps must be greater than {args.warmup_steps + 1}")
    if not 0 <= args.profile_step <= args.steps:
        raise BenchError(f"--profile-step must be within the {args.steps} steps (0: none)")
    if args.threads < 1:
        raise BenchError("--threads must be at least 1")
    if args.world is None:
        args.world = 1 if args.device == "cuda" else 2
    if args.device == "cuda" and args.world != 1:
        raise BenchError("--device cuda runs one rank on the one GPU (--world 1)")
    cfg = load_config(args.config, args.steps)
    data = get(cfg, "data.train")
    if not os.path.isfile(data):
        raise BenchError(f"token file {data} not found (scripts/make_corpus.sh builds the default)")
    seq_len = int(get(cfg, "data.seq_len"))
    tokens_per_step = int(get(cfg, "data.batch_size")) * seq_len * int(get(cfg, "train.grad_accum", 1))
    gpu = GpuMemory() if args.device == "cuda" else None
    memory = "GPU MiB" if gpu else "RSS MiB"

    tmp = tempfile.mkdtemp(prefix="fsdpp-bench-fsdp-")  # kept on failure for its logs
    args.init_dir, n_params, hf_config = write_initial_model(cfg, os.path.join(tmp, "initial-model"))
    if args.lora_rank:
        args.adapter_dir = write_initial_adapter(args.init_dir, args.lora_rank, os.path.join(tmp, "initial-adapter"))
    results = {}
    for name, run in (("fsdpp", run_fsdpp), ("pytorch", run_torch)):
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
    shutil.rmtree(tmp, ignore_errors=True)

    ranks = sorted(results["fsdpp"]["memory"])
    print()
    print(f"{'engine':<10}{'step s':>10}{'tokens/s':>11}" + "".join(f"{f'{memory} r{r}':>14}" for r in ranks)
          + f"{'first loss':>12}{'final loss':>12}")
    for name, r in results.items():
        print(f"{name:<10}{r['step_s']:>10.4f}{r['tokens_per_s']:>11.1f}"
              + "".join(f"{r['memory'][k]:>14.1f}" for k in ranks)
              + f"{r['first_loss']:>12.4f}{r['final_loss']:>12.4f}")
    f, t = results["fsdpp"], results["pytorch"]
    print()
    print(f"step time ratio (fsdpp / pytorch fully_shard): {f['step_s'] / t['step_s']:.2f}x")
    for rank in ranks:
        print(f"peak {memory.split()[0]} ratio rank {rank} (fsdpp / pytorch fully_shard): "
              f"{f['memory'][rank] / t['memory'][rank]:.2f}x")
    if gpu:
        flops = flops_per_token(n_params, hf_config, seq_len)
        for name, r in results.items():
            mfu = r["tokens_per_s"] * flops / (args.peak_tflops * 1e12 * args.world)
            print(f"MFU {name}: {100 * mfu:.1f}% ({n_params / 1e6:.0f}M parameters, {flops / 1e9:.2f} GFLOP per "
                  f"token, peak {args.peak_tflops:g} TFLOP/s)")
    # Same weights, data and optimiser: the curves must agree, or the timings compare
    # different work.
    print(f"step-1 loss: fsdpp {f['first_loss']:.6f}, pytorch fully_shard {t['first_loss']:.6f}; "
          f"grad norm: fsdpp {f['first_grad_norm']:.6f}, pytorch fully_shard {t['first_grad_norm']:.6f}")
    check_trained_alike(f["final_loss"], t["final_loss"],
                        BF16_LOSS_TOLERANCE if args.param_dtype == "bfloat16" else LOSS_TOLERANCE)


# ---------------------------------------------------------------- PyTorch FSDP2 worker


# LoRA targets of the benchmark's adapters: the attention projections (the shipped policies'
# default lora_targets).
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]


def write_initial_adapter(init_dir, rank, out_dir):
    """A fresh PEFT adapter on the initial model (B zero, A as peft draws it), which both
    engines start from: the same initial A makes their losses comparable step by step."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(init_dir, dtype=torch.float32)
    get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=LORA_TARGETS)).save_pretrained(out_dir)
    return out_dir


def build_sharded_model(cfg, world, init_dir, device, param_dtype, activation_checkpoint=False, offload=False,
                        adapter_dir=None):
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
    from transformers import AutoModelForCausalLM

    if get(cfg, "model.dtype", "float32") != "float32":
        raise BenchError("only model.dtype = \"float32\" is benchmarked")
    if not hasattr(FSDPModule, "set_gradient_divide_factor"):
        raise BenchError(f"torch {torch.__version__} lacks FSDPModule.set_gradient_divide_factor")
    # Offloaded, the weights stay on the host and fully_shard moves its shards there.
    model = AutoModelForCausalLM.from_pretrained(init_dir, dtype=torch.float32, attn_implementation="sdpa")
    if adapter_dir:  # peft's LoRA on the frozen base, sharded as the rest
        from peft import PeftModel
        model = PeftModel.from_pretrained(model, adapter_dir, is_trainable=True)
    if not offload:
        model = model.to(device)
    hf_config = model.config
    base = model.get_base_model() if adapter_dir else model
    if activation_checkpoint:  # each decoder layer recomputed in backward, as fsdpp's policy option
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    mesh = init_device_mesh(device, (world,))
    # fp32 masters with compute in param_dtype and fp32 reductions, as fsdpp's param_dtype.
    mp = MixedPrecisionPolicy(param_dtype=getattr(torch, param_dtype) if param_dtype else None,
                              reduce_dtype=torch.float32)
    options = dict(mesh=mesh, mp_policy=mp, offload_policy=CPUOffloadPolicy() if offload else OffloadPolicy())
    # The plan of fsdpp's shipped policies (policies/lib/fsdp.lua): a unit per layer, the
    # embedding and lm_head (one unit when tied), the root keeping the rest gathered.
    for layer in base.model.layers:
        fully_shard(layer, reshard_after_forward=True, **options)
    if hf_config.tie_word_embeddings:
        fully_shard([base.model.embed_tokens, base.lm_head], reshard_after_forward=True, **options)
    else:
        fully_shard(base.model.embed_tokens, reshard_after_forward=True, **options)
        fully_shard(base.lm_head, reshard_after_forward=True, **options)
    fully_shard(model, reshard_after_forward=False, **options)
    # fsdpp sums gradients over ranks and divides the loss by the global token count; FSDP2
    # averages by default. A factor of 1 makes it sum, and forcing plain SUM reductions keeps
    # it off NCCL's PreMulSum, which gloo does not have. Both settings are per unit.
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    return model


def torch_worker(args):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.tensor import DTensor

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    cfg = load_config(args.config, args.steps)
    torch.set_num_threads(args.threads)
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    try:
        seq_len = int(get(cfg, "data.seq_len"))
        batch = int(get(cfg, "data.batch_size"))
        if batch % world != 0:
            raise BenchError(f"data.batch_size {batch} is not a multiple of the world size {world}")
        rows = batch // world
        tokens, file_vocab = read_tokens(get(cfg, "data.train"))
        held_out = int(len(tokens) * float(get(cfg, "data.eval_fraction", 0.0)))
        sampler = WindowSampler(tokens[:len(tokens) - held_out], seq_len)

        model = build_sharded_model(cfg, world, args.init_dir, args.device, args.param_dtype,
                                    args.activation_checkpoint, args.offload, args.adapter_dir)
        if file_vocab > model.config.vocab_size:
            raise BenchError(f"token file vocab {file_vocab} exceeds model vocab "
                             f"{model.config.vocab_size}")
        model.train()
        params = [p for p in model.parameters() if p.requires_grad]  # a LoRA run's frozen base has no state
        opt = torch.optim.AdamW(
            [{"params": [p for p in params if p.ndim >= 2],
              "weight_decay": float(get(cfg, "optimizer.weight_decay", 0.0))},
             {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
            lr=float(get(cfg, "optimizer.lr")),
            betas=(float(get(cfg, "optimizer.beta1", 0.9)),
                   float(get(cfg, "optimizer.beta2", 0.999))),
            eps=float(get(cfg, "optimizer.eps", 1e-8)), fused=True)  # fsdpp's AdamW is fused too

        steps = int(get(cfg, "train.steps"))
        accum = int(get(cfg, "train.grad_accum", 1))
        clip = float(get(cfg, "train.clip_grad_norm", 0.0))
        step_tokens = accum * batch * seq_len
        metrics = None
        if rank == 0:
            os.makedirs(args.out_dir, exist_ok=True)
            metrics = open(os.path.join(args.out_dir, "metrics.jsonl"), "w")

        begin = time.perf_counter()
        profiler = None
        for step in range(1, steps + 1):
            if step == args.profile_step:
                activities = [torch.profiler.ProfilerActivity.CPU]
                if args.device == "cuda":
                    activities.append(torch.profiler.ProfilerActivity.CUDA)
                profiler = torch.profiler.profile(activities=activities)
                profiler.start()
            step_begin = time.perf_counter()
            lr = lr_at(step, cfg)
            for group in opt.param_groups:
                group["lr"] = lr
            opt.zero_grad(set_to_none=True)
            loss_sum = torch.zeros((), dtype=torch.float64, device=args.device)
            for _ in range(accum):
                window = torch.from_numpy(sampler.take(batch)[rank * rows:(rank + 1) * rows]).to(args.device)
                logits = model(input_ids=window[:, :-1], use_cache=False).logits
                loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                                       window[:, 1:].reshape(-1), reduction="sum") / step_tokens
                loss.backward()
                loss_sum += loss.detach().double()
            dist.all_reduce(loss_sum)  # fsdpp reports the global loss the same way
            if clip > 0:
                norm = torch.nn.utils.clip_grad_norm_(params, clip)
            else:
                norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
            if isinstance(norm, DTensor):
                norm = norm.full_tensor()
            grad_norm = norm.item()
            opt.step()
            if profiler is not None:
                if args.device == "cuda":
                    torch.cuda.synchronize()
                profiler.stop()
                os.makedirs(args.out_dir, exist_ok=True)
                profiler.export_chrome_trace(os.path.join(args.out_dir, f"profile-step-{step}-rank-{rank}.json"))
                profiler = None
            now = time.perf_counter()
            if metrics:
                metrics.write(json.dumps({
                    "step": step, "loss": loss_sum.item(), "lr": lr, "grad_norm": grad_norm,
                    "tokens_per_s": step_tokens / (now - step_begin), "elapsed_s": now - begin,
                    "tokens": step * step_tokens}) + "\n")
                metrics.flush()
        if metrics:
            metrics.close()
    finally:
        dist.destroy_process_group()


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
                 ("--param-dtype", {"choices": ["bfloat16", "float16"],
                                    "help": "compute dtype over fp32 masters, fp32 reductions (default: the model's)"}),
                 ("--activation-checkpoint", {"action": "store_true",
                                              "help": "both engines recompute each decoder layer in backward"}),
                 ("--offload", {"action": "store_true",
                                "help": "both engines keep fp32 masters, gradients and optimizer state on the host"}),
                 ("--profile-step", {"type": int, "default": 0,
                                     "help": "trace this step in both engines and summarise where its GPU time went"}),
                 ("--trace-dir", {"help": "keep the --profile-step traces here as ENGINE-step-N.json"}),
                 ("--peak-tflops", {"type": float, "default": 989.0,
                                    "help": "the GPU's dense bf16 peak for MFU (default: %(default)s, H100/H200 SXM)"}),
                 ("--lora-rank", {"type": int, "default": 0,
                                  "help": "train LoRA adapters of this rank on the attention projections, the base "
                                          "frozen: fsdpp from a PEFT adapter, the peer with peft (default: full "
                                          "fine-tuning)"}),
                 ("--adapter-dir", {"help": argparse.SUPPRESS}),
             ])
