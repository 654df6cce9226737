#!/usr/bin/env python3
# Benchmarks fsdpp training against the same model, data and optimiser written in plain
# PyTorch, reporting throughput, peak memory and final loss of each (for a MoE model, the loss
# with transformers' load-balancing loss). Both start from one set of
# initial weights made by transformers and train on the same batches (windows in file order),
# so their losses must agree; the benchmark fails when they part.
# Run with the project venv from the repository root: .venv/bin/python scripts/bench_train.py
#
# Each engine runs in its own child process so that its peak RSS can be read from the
# rusage os.wait4 returns for exactly that child; getrusage(RUSAGE_CHILDREN) only gives the
# maximum over all children. Both children write a metrics.jsonl in the same format and
# throughput is computed from those files by one function, so the two are measured alike.
import json
import os
import subprocess
import sys
import tempfile
import time
import tomllib

from bench_common import (LOSS_TOLERANCE, BenchError, WindowSampler,
                          check_trained_alike, experts_kernel, get, read_toml, lr_at, read_step_records, read_tokens,
                          routed_experts, run_main, write_initial_model)

WARMUP_STEPS = 10  # steps left out of the throughput figure (allocation, thread start-up)


# ---------------------------------------------------------------- configuration


def overrides(args, out_dir):
    return [
        f"train.steps={args.steps}",
        f"train.threads={args.threads}",
        f"train.out_dir={json.dumps(out_dir)}",  # a JSON string is a valid TOML string
        f"model.path={json.dumps(args.init_dir)}",
        "data.shuffle=false",
        "checkpoint.save_final=false",
        "train.eval_every=0",
    ] + ["train.log_every=1"] * args.smoke  # smoke's one-step warm-up must end on a logged step


def parse_value(text):
    # Values are TOML when they parse as TOML, so `false` and `60` keep their types, and
    # bare strings otherwise, so paths need no quoting.
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def load_config(path, sets):
    cfg = read_toml(path)
    for s in sets:
        key, _, value = s.partition("=")
        *parents, leaf = key.split(".")
        table = cfg
        for p in parents:
            table = table.setdefault(p, {})
        table[leaf] = parse_value(value)
    return cfg


# ---------------------------------------------------------------- measurement


def summarise(path, warmup_steps):
    records = read_step_records(path)
    # The baseline is the first logged step at or after the warm-up, so engines that log
    # only every few steps are still measured over the same span.
    base = next((r for r in records if r["step"] >= warmup_steps), None)
    last = records[-1] if records else None
    if base is None or last["step"] <= base["step"]:
        raise BenchError(f"{path}: need logged steps after step {warmup_steps} to measure throughput")
    seconds = last["elapsed_s"] - base["elapsed_s"]
    if seconds <= 0:
        raise BenchError(f"{path}: elapsed_s does not increase")
    return {
        "tokens_per_s": (last["tokens"] - base["tokens"]) / seconds,
        "losses": [r["loss"] for r in records],
        "first_loss": records[0]["loss"],
        "final_loss": last["loss"],
        "final_step": last["step"],
    }


def run_child(name, cmd, log_path):
    with open(log_path, "wb") as log:
        try:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        except OSError as e:
            raise BenchError(f"cannot start {name}: {e.strerror}")
        _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        with open(log_path, errors="replace") as log:
            tail = log.readlines()[-20:]
        sys.stderr.writelines(tail)
        raise BenchError(f"{name} exited with status {proc.returncode} (its output is above)")
    return usage.ru_maxrss / 1024.0  # Linux reports KiB


def bench(args):
    if not (os.path.isfile(args.fsdpp) and os.access(args.fsdpp, os.X_OK)):
        raise BenchError(f"fsdpp binary {args.fsdpp} not found or not executable; build it first "
                         "or pass --fsdpp")
    if args.steps <= args.warmup_steps:
        raise BenchError(f"--steps must be greater than {args.warmup_steps}")

    results = {}
    with tempfile.TemporaryDirectory(prefix="fsdpp-bench-") as tmp:
        fsdpp_dir = os.path.join(tmp, "fsdpp")
        torch_dir = os.path.join(tmp, "pytorch")
        cfg = read_toml(args.config)
        if args.model_path:
            cfg.setdefault("model", {})["path"] = args.model_path
        args.init_dir, _, hf_config = write_initial_model(cfg, os.path.join(tmp, "initial-model"))
        moe = routed_experts(hf_config) > 0
        # Checked here so a missing corpus is reported plainly rather than by a child.
        data = get(load_config(args.config, overrides(args, fsdpp_dir)), "data.train")
        if not os.path.isfile(data):
            raise BenchError(f"token file {data} not found "
                             "(scripts/make_corpus.sh builds the default)")
        fsdpp_cmd = [args.fsdpp, "train", args.config]
        for s in overrides(args, fsdpp_dir):
            fsdpp_cmd += ["--set", s]
        torch_cmd = [sys.executable, os.path.abspath(__file__), "--torch-worker",
                     "--config", args.config, "--steps", str(args.steps),
                     "--threads", str(args.threads), "--out-dir", torch_dir,
                     "--init-dir", args.init_dir] + ["--smoke"] * args.smoke

        for name, cmd, out_dir in (("fsdpp", fsdpp_cmd, fsdpp_dir),
                                   ("pytorch", torch_cmd, torch_dir)):
            print(f"running {name} ({args.steps} steps, {args.threads} threads)...", flush=True)
            rss = run_child(name, cmd, os.path.join(tmp, f"{name}.log"))
            results[name] = summarise(os.path.join(out_dir, "metrics.jsonl"), args.warmup_steps)
            results[name]["rss_mib"] = rss

    print()
    print(f"{'engine':<10}{'tokens/s':>12}{'peak RSS MiB':>15}{'first loss':>12}{'final loss':>12}")
    for name, r in results.items():
        print(f"{name:<10}{r['tokens_per_s']:>12.1f}{r['rss_mib']:>15.1f}{r['first_loss']:>12.4f}"
              f"{r['final_loss']:>12.4f}")
    f, t = results["fsdpp"], results["pytorch"]
    print()
    print(f"tokens/s ratio (fsdpp / pytorch): {f['tokens_per_s'] / t['tokens_per_s']:.2f}x")
    print(f"peak RSS ratio (fsdpp / pytorch): {f['rss_mib'] / t['rss_mib']:.2f}x")
    check_trained_alike(f["losses"], t["losses"], LOSS_TOLERANCE, moe)


# ---------------------------------------------------------------- PyTorch reference


def torch_worker(args):
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    cfg = load_config(args.config, overrides(args, args.out_dir))
    if args.threads > 0:
        torch.set_num_threads(args.threads)

    if get(cfg, "model.dtype", "float32") != "float32":
        raise BenchError("only model.dtype = \"float32\" is benchmarked")
    tokens, file_vocab = read_tokens(get(cfg, "data.train"))
    model = AutoModelForCausalLM.from_pretrained(args.init_dir, dtype=torch.float32, attn_implementation="sdpa",
                                                 **experts_kernel(args.init_dir, 4))
    vocab = model.config.vocab_size
    if file_vocab > vocab:
        raise BenchError(f"token file vocab {file_vocab} exceeds model vocab {vocab}")
    model.train()
    moe = getattr(model.config, "router_aux_loss_coef", None) is not None

    seq_len = int(get(cfg, "data.seq_len"))
    batch = int(get(cfg, "data.batch_size"))
    held_out = int(len(tokens) * float(get(cfg, "data.eval_fraction", 0.0)))
    sampler = WindowSampler(tokens[:len(tokens) - held_out], seq_len)

    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": float(get(cfg, "optimizer.weight_decay", 0.0))},
         {"params": no_decay, "weight_decay": 0.0}],
        lr=float(get(cfg, "optimizer.lr")),
        betas=(float(get(cfg, "optimizer.beta1", 0.9)), float(get(cfg, "optimizer.beta2", 0.999))),
        eps=float(get(cfg, "optimizer.eps", 1e-8)),
        fused=True,  # one kernel over every parameter, as fsdpp's AdamW runs (PyTorch's default here is a loop)
    )

    steps = int(get(cfg, "train.steps"))
    accum = int(get(cfg, "train.grad_accum", 1))
    clip = float(get(cfg, "train.clip_grad_norm", 0.0))
    tokens_per_step = batch * seq_len * accum

    os.makedirs(args.out_dir, exist_ok=True)
    metrics = open(os.path.join(args.out_dir, "metrics.jsonl"), "w")
    start = time.perf_counter()
    last_time, last_tokens = start, 0
    for step in range(1, steps + 1):
        lr = lr_at(step, cfg)
        for group in opt.param_groups:
            group["lr"] = lr
        opt.zero_grad(set_to_none=True)
        step_loss = 0.0
        for _ in range(accum):
            window = torch.from_numpy(sampler.take(batch))  # [B, T + 1]
            out = model(input_ids=window[:, :-1], use_cache=False, output_router_logits=moe)
            loss = F.cross_entropy(out.logits.reshape(-1, out.logits.shape[-1]).float(),
                                   window[:, 1:].reshape(-1))
            if moe:  # the load-balancing loss transformers adds in training, as fsdpp does
                loss = loss + model.config.router_aux_loss_coef * out.aux_loss
            (loss / accum).backward()
            step_loss += loss.item() / accum
        if clip > 0:
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item()
        else:
            grad_norm = torch.linalg.vector_norm(
                torch.stack([p.grad.norm() for p in model.parameters() if p.grad is not None])).item()
        opt.step()

        # Every step, as fsdpp's metrics.jsonl holds every step: records compare step by step.
        now = time.perf_counter()
        done = step * tokens_per_step
        record = {"step": step, "loss": step_loss, "lr": lr, "grad_norm": grad_norm,
                  "tokens_per_s": (done - last_tokens) / (now - last_time),
                  "elapsed_s": now - start, "tokens": done}
        metrics.write(json.dumps(record) + "\n")
        metrics.flush()
        last_time, last_tokens = now, done
    metrics.close()


if __name__ == "__main__":
    run_main("bench_train",
             "Train the same model with fsdpp and with plain PyTorch (transformers + AdamW) on the "
             "CPU, from the same initial weights and batches, and compare tokens/s, peak RSS and losses. Relative paths, including those "
             "inside the config, resolve against the current directory.",
             steps=60, threads=2, warmup_steps=WARMUP_STEPS, bench=bench, torch_worker=torch_worker,
             extra_args=(("--model-path", {"help": "HF config directory of the model to train instead of the "
                                                   "config's [model] path"}),))
