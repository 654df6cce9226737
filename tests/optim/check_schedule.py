"""The learning rate of every step of `fsdpp train`, against transformers' schedules.

For each [scheduler] (cosine with and without a floor, linear, constant; with warmup, none,
and warmup over the whole run; one step alone), a short run of the tiny Llama logs each
step's learning rate to metrics.jsonl. After warmup, step s must take what transformers'
get_cosine_with_min_lr_schedule_with_warmup (get_linear_schedule_with_warmup,
get_constant_schedule_with_warmup) gives its step s - 1 counted from 0, as a Trainer steps
it once per optimizer step: the first step after warmup at the peak, the last one short of
the floor. Warmup rises from peak / warmup_steps at step 1, where transformers' first step
has 0. Every rate within 1e-12 relative.

usage: check_schedule.py FSDPP WORK_DIR
"""
import json
import os
import shutil
import subprocess
import sys

import torch
from transformers import (get_constant_schedule_with_warmup, get_cosine_with_min_lr_schedule_with_warmup,
                          get_linear_schedule_with_warmup)

PEAK = 1e-2
CASES = [  # kind, warmup_steps, min_lr_ratio, steps
    ("cosine", 2, 0.1, 7), ("cosine", 0, 0.0, 5), ("cosine", 5, 0.0, 5), ("cosine", 0, 0.0, 1),
    ("linear", 3, 0.0, 8), ("linear", 0, 0.0, 1), ("constant", 2, 0.0, 4),
]


def transformers_rates(kind, warmup, floor, steps):
    """The rate of each optimizer step 0 .. steps - 1 as a Trainer's scheduler gives it."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=PEAK)
    if kind == "cosine":
        scheduler = get_cosine_with_min_lr_schedule_with_warmup(optimizer, warmup, steps, min_lr_rate=floor)
    elif kind == "linear":
        scheduler = get_linear_schedule_with_warmup(optimizer, warmup, steps)
    else:
        scheduler = get_constant_schedule_with_warmup(optimizer, warmup)
    rates = []
    for _ in range(steps):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return rates


def fsdpp_rates(fsdpp, work, kind, warmup, floor, steps):
    out = os.path.join(work, f"{kind}-{warmup}-{floor}-{steps}")
    shutil.rmtree(out, ignore_errors=True)
    subprocess.run([fsdpp, "train", "examples/tiny-llama.toml", "--set", f'train.out_dir="{out}"',
                    "--set", f"train.steps={steps}", "--set", "train.threads=1", "--set", f"optimizer.lr={PEAK}",
                    "--set", f'scheduler.kind="{kind}"', "--set", f"scheduler.warmup_steps={warmup}",
                    "--set", f"scheduler.min_lr_ratio={floor}", "--set", "checkpoint.save_final=false",
                    "--set", "checkpoint.save_every=0", "--set", "train.eval_every=0",
                    "--set", 'metrics.progress="never"', "--set", "data.eval_fraction=0.0"],
                   check=True, capture_output=True, timeout=300)
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line)["lr"] for line in f if '"lr"' in line]


def main():
    fsdpp, work = sys.argv[1], sys.argv[2]
    os.makedirs(work, exist_ok=True)
    subprocess.run(["bash", "scripts/make_corpus.sh"], check=True, stdout=subprocess.DEVNULL)  # data/licenses.tok
    ok = True
    for kind, warmup, floor, steps in CASES:
        got = fsdpp_rates(fsdpp, work, kind, warmup, floor, steps)
        reference = transformers_rates(kind, warmup, floor, steps)
        # fsdpp's step s (from 1) after warmup takes transformers' step s - 1 (from 0).
        want = [PEAK * s / warmup if s <= warmup else reference[s - 1] for s in range(1, steps + 1)]
        good = len(got) == steps and all(abs(g - w) <= 1e-12 * PEAK for g, w in zip(got, want))
        ok &= good
        print(f"{'ok  ' if good else 'FAIL'} {kind}, warmup {warmup}, floor {floor}, {steps} steps: "
              f"{' '.join(f'{g:.6g}' for g in got)} (want {' '.join(f'{w:.6g}' for w in want)})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
