"""FSDP on N ranks must train like one process: the same run (tests/assets/fsdp-llama.toml)
as a single plain process and through `fsdpp launch` at several world sizes must give the
same loss at every step and the same final weights, within 1e-5 relative (of each tensor's
largest magnitude). Usage: check_fsdp.py WORLD... [--set KEY=VALUE ...]
[--reference-world N --tolerance T]: a reference run through the launcher at world N (for
mixed precision, whose fp32 master shards a plain process does not keep) and a tolerance.
[--tested-set KEY=VALUE ...]: settings of the runs under test only, e.g. a GPU device
against a reference on the CPU."""
import argparse
import json
import os
import shutil
import subprocess
import sys

from safetensors.torch import load_file

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from compare import max_relative, weight_difference  # noqa: E402

FSDPP = os.environ["FSDPP"]
WORK = os.environ["WORK"]
CONFIG = "tests/assets/fsdp-llama.toml"


def run(out_dir, world, sets):
    shutil.rmtree(out_dir, ignore_errors=True)
    args = ["train", CONFIG, "--set", f'train.out_dir="{out_dir}"'] + [a for s in sets for a in ("--set", s)]
    cmd = [FSDPP] + args if world == 0 else [FSDPP, "launch", "--nproc-per-node", str(world), "--"] + args
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        sys.exit(f"FAIL: {' '.join(cmd)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    records = [json.loads(l) for l in open(os.path.join(out_dir, "metrics.jsonl"))]
    losses = [r["loss"] for r in records if "loss" in r]
    eval_losses = [r["eval_loss"] for r in records if "eval_loss" in r]
    weights = {k: v.float() for k, v in load_file(os.path.join(out_dir, "model", "model.safetensors")).items()}
    return losses, eval_losses, weights


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("worlds", type=int, nargs="+")
    ap.add_argument("--set", action="append", default=[], dest="sets")
    ap.add_argument("--tested-set", action="append", default=[], dest="tested_sets")
    ap.add_argument("--name", default="default")
    ap.add_argument("--reference-world", type=int, default=0, help="0: a plain process")
    ap.add_argument("--tolerance", type=float, default=1e-5)
    ap.add_argument("--weight-tolerance", type=float, help="weights by ||a - b|| / ||b|| instead of max-abs")
    args = ap.parse_args()
    subprocess.run(["bash", "scripts/make_corpus.sh"], check=True, capture_output=True)
    base = os.path.join(WORK, "fsdp", args.name)
    ref_losses, ref_evals, ref_weights = run(os.path.join(base, "single"), args.reference_world, args.sets)
    failures = 0
    for world in args.worlds:
        losses, evals, weights = run(os.path.join(base, f"world{world}"), world, args.sets + args.tested_sets)
        loss_err = max_relative(losses + evals, ref_losses + ref_evals)  # held-out losses too, when evaluated
        weight_err, worst = weight_difference(weights, ref_weights, by_norm=bool(args.weight_tolerance))
        ok = len(losses) == len(ref_losses) and len(evals) == len(ref_evals) and loss_err < args.tolerance \
            and weight_err < (args.weight_tolerance or args.tolerance) \
            and weights.keys() == ref_weights.keys()
        failures += not ok
        print(f"{'ok  ' if ok else 'FAIL'} world {world} {args.name}: {len(losses)} steps, {len(evals)} evaluations, max relative loss "
              f"difference {loss_err:.2e}, max relative weight difference {weight_err:.2e} ({worst}); "
              f"final loss {losses[-1]:.6f} vs one process {ref_losses[-1]:.6f}")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
