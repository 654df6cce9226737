#!/usr/bin/env python3
# Packing documents into rows, measured on the chat fine-tuning example (examples/sft-chat.toml,
# its data made on the spot by scripts/make_sft_example.py), in one run:
#   - fsdpp with [data] packing = true and = false: tokens/s over every slot of a row and over
#     the documents' own tokens, and the share of padding each leaves;
#   - the packed step against transformers (sdpa attention, position_ids restarting at each
#     document, so that attention stays inside each) on the same rows from the same weights,
#     with AdamW: step time, and the first step's loss, which must agree.
# Run with the project venv from the repository root: .venv/bin/python scripts/bench_packing.py
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

from bench_common import LOSS_TOLERANCE, BenchError, get, read_step_records, read_toml, run_main
from packed_rows import best_fit, pieces, read_token_file

CONFIG = "examples/sft-chat.toml"


def make_data(tmp, chats):
    subprocess.run([sys.executable, "scripts/make_sft_example.py", tmp, "--train", str(chats), "--heldout", "1"],
                   check=True, capture_output=True)
    data = os.path.join(tmp, "train.tok")
    subprocess.run([sys.executable, "scripts/prepare_data.py", "--tokenizer", os.path.join(tmp, "model"),
                    "--out", data, os.path.join(tmp, "train.jsonl")], check=True, capture_output=True)
    return os.path.join(tmp, "model"), data


def step_times(records):
    """Seconds each logged step took (every step is logged here)."""
    return [b["elapsed_s"] - a["elapsed_s"] for a, b in zip(records, records[1:])]


def run_fsdpp(args, model, data, out_dir, packing):
    sets = [f"model.path={json.dumps(model)}", f"data.train={json.dumps(data)}", f"data.packing={str(packing).lower()}",
            "data.shuffle=false", f"train.steps={args.steps}", f"train.threads={args.threads}", "train.log_every=1",
            f"train.out_dir={json.dumps(out_dir)}", "checkpoint.save_final=false", 'metrics.progress="never"']
    cmd = [args.fsdpp, "train", CONFIG] + [a for s in sets for a in ("--set", s)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise BenchError(f"fsdpp exited {proc.returncode}: {proc.stderr.strip().splitlines()[-1:]}")
    padding = re.search(r"data: .* ([0-9.e+-]+)% padding", proc.stderr)
    if not padding:
        raise BenchError("fsdpp's log states no padding share")
    records = read_step_records(os.path.join(out_dir, "metrics.jsonl"))
    step_s = statistics.median(step_times(records)[args.warmup_steps:])
    slots = records[-1]["tokens"] / records[-1]["step"]
    share = float(padding.group(1)) / 100
    return {"step_s": step_s, "slots_per_s": slots / step_s, "tokens_per_s": slots * (1 - share) / step_s,
            "padding": share, "first_loss": records[0]["loss"]}


def run_transformers(args, model_dir, data, batch, seq_len):
    """The first `batch` packed rows, through transformers with packed position_ids."""
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    tokens, ends, mask, _ = read_token_file(data)
    rows = best_fit(pieces(ends, mask, seq_len, completion=True), seq_len)[:batch]
    ids = torch.zeros(len(rows), seq_len, dtype=torch.long)
    positions = torch.arange(seq_len).repeat(len(rows), 1)  # padding counts on from the last document
    targets = torch.full((len(rows), seq_len), -100)
    for r, row in enumerate(rows):
        at = 0
        for begin, length, end, _ in row:
            if begin + length != end:
                raise BenchError("a document longer than seq_len: transformers' packed rows cannot cut one")
            ids[r, at:at + length] = torch.tensor(tokens[begin:end])
            positions[r, at:at + length] = torch.arange(length)
            marked = torch.tensor(mask[begin + 1:end]).bool()
            targets[r, at:at + length - 1] = torch.tensor(tokens[begin + 1:end]).masked_fill(~marked, -100)
            at += length
        positions[r, at:] = torch.arange(seq_len - at)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    model.train()
    # The step's work as fsdpp's: the example's clipping and learning rate, a fused AdamW. The
    # rows are the first 16 every step, where fsdpp goes on to others of the same layout.
    cfg = read_toml(CONFIG)
    clip = float(get(cfg, "train.clip_grad_norm", 1.0))
    opt = torch.optim.AdamW(model.parameters(), lr=float(get(cfg, "optimizer.lr")), weight_decay=0.0, fused=True)
    count = (targets != -100).sum()
    times, first_loss = [], None
    for _ in range(args.steps):
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        logits = model(input_ids=ids, position_ids=positions, use_cache=False).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum") / count
        loss.backward()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        times.append(time.perf_counter() - start)
        first_loss = loss.item() if first_loss is None else first_loss
    return {"step_s": statistics.median(times[args.warmup_steps:]), "first_loss": first_loss}


def bench(args):
    if not (os.path.isfile(args.fsdpp) and os.access(args.fsdpp, os.X_OK)):
        raise BenchError(f"fsdpp binary {args.fsdpp} not found or not executable; build it first or pass --fsdpp")
    if args.steps <= args.warmup_steps + 1:
        raise BenchError(f"--steps must be greater than {args.warmup_steps + 1}")
    with tempfile.TemporaryDirectory(prefix="fsdpp-bench-packing-") as tmp:
        model, data = make_data(tmp, 400 if args.smoke else 4000)
        results = {"fsdpp packed": run_fsdpp(args, model, data, os.path.join(tmp, "packed"), True),
                   "fsdpp unpacked": run_fsdpp(args, model, data, os.path.join(tmp, "unpacked"), False)}
        results["transformers packed"] = run_transformers(args, model, data, 16, 256)
    print()
    print(f"{'run':<22}{'step s':>9}{'slots/s':>10}{'tokens/s':>10}{'padding':>9}{'first loss':>12}")
    for name, r in results.items():
        fsdpp_only = (f"{r['slots_per_s']:>10.0f}{r['tokens_per_s']:>10.0f}{100 * r['padding']:>8.1f}%"
                      if "padding" in r else f"{'':>10}{'':>10}{'':>9}")
        print(f"{name:<22}{r['step_s']:>9.4f}{fsdpp_only}{r['first_loss']:>12.6f}")
    packed, unpacked, peer = results["fsdpp packed"], results["fsdpp unpacked"], results["transformers packed"]
    print()
    print(f"document tokens/s ratio (packed / unpacked): {packed['tokens_per_s'] / unpacked['tokens_per_s']:.2f}x")
    print(f"packed step time ratio (fsdpp / transformers): {packed['step_s'] / peer['step_s']:.2f}x")
    gap = abs(packed["first_loss"] - peer["first_loss"]) / abs(peer["first_loss"])
    print(f"first-step loss relative difference, packed fsdpp vs transformers: {gap:.2e}")
    if gap > LOSS_TOLERANCE:
        raise BenchError(f"the packed first-step losses differ by {gap:.2e} (more than {LOSS_TOLERANCE:g}): "
                         "the engines did not compute the same rows")


if __name__ == "__main__":
    run_main("bench_packing",
             "fsdpp with packed and unpacked documents on the chat fine-tuning example, and the packed step "
             "against transformers with packed position_ids on the same rows.",
             steps=30, threads=2, warmup_steps=5, bench=bench, torch_worker=None)
