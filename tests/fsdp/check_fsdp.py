"""FSDP on N ranks must train like one process: the same run (tests/assets/fsdp-llama.toml)
as a single plain process and through `fsdpp launch` at several world sizes must give the
same loss at every step and the same final weights. A plain process applies the policy's
plan as a launched world of 1 does, so a feature under test (activation checkpointing,
offload, a policy) is best given with --tested-set, leaving the reference without it. By default the model is float64 and the
bound is compare.FLOAT64_BOUND (1e-10 relative, of each tensor's largest magnitude).
Usage: check_fsdp.py WORLD... [--set KEY=VALUE ...] [--dtype D]
[--reference-world N --tolerance T]: a reference run through the launcher at world N, and a
tolerance.
[--tested-set KEY=VALUE ...] / [--reference-set KEY=VALUE ...]: settings of the runs under
test only, or of the reference only, e.g. a GPU device against a reference on the CPU.
[--floor-world N --floor-factor F]: instead of fixed tolerances, measure the rounding noise
floor first, as the gap between the reference and the same settings at world N (which
only reorders sums), and allow F times that gap (at least F float32 epsilons).
[--floor-limit L]: the floor itself must stay below L in losses and weights: a larger gap at
world N is a defect the factor would otherwise excuse.
[--metric NAME ...]: a further figure every step must log (a MoE model's aux_loss,
expert_load), compared step by step as the loss is.
[--expect-log TEXT]: every run's log must hold TEXT (a start-up line, say).
Differences are allowed up to the bounds inclusive: --tolerance 0 asks for bitwise equality."""
import argparse
import json
import os
import shutil
import subprocess
import sys

from safetensors.torch import load_file

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from compare import FLOAT64_BOUND, max_relative, weight_difference  # noqa: E402

FSDPP = os.environ["FSDPP"]
WORK = os.environ["WORK"]
CONFIG = "tests/assets/fsdp-llama.toml"


def run(out_dir, world, sets, metrics, expect_log=None):
    shutil.rmtree(out_dir, ignore_errors=True)
    args = ["train", CONFIG, "--set", f'train.out_dir="{out_dir}"'] + [a for s in sets for a in ("--set", s)]
    cmd = [FSDPP] + args if world == 0 else [FSDPP, "launch", "--nproc-per-node", str(world), "--"] + args
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        sys.exit(f"FAIL: {' '.join(cmd)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    if expect_log and expect_log not in proc.stdout + proc.stderr:
        sys.exit(f"FAIL: the log of {' '.join(cmd)} lacks {expect_log!r}:\n{proc.stderr[-3000:]}")
    records = [json.loads(l) for l in open(os.path.join(out_dir, "metrics.jsonl"))]
    steps = [r for r in records if "loss" in r]
    missing = sorted({m for m in metrics for r in steps if m not in r})
    if missing:
        sys.exit(f"FAIL: {out_dir}/metrics.jsonl lacks {', '.join(missing)} at some step")
    losses = [r["loss"] for r in steps]
    eval_losses = [r["eval_loss"] for r in records if "eval_loss" in r]
    figures = [r[m] for m in metrics for r in steps]
    weights = {k: v.double() for k, v in load_file(os.path.join(out_dir, "model", "model.safetensors")).items()}
    return losses, eval_losses, figures, weights


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("worlds", type=int, nargs="+")
    ap.add_argument("--set", action="append", default=[], dest="sets")
    ap.add_argument("--tested-set", action="append", default=[], dest="tested_sets")
    ap.add_argument("--reference-set", action="append", default=[], dest="reference_sets")
    ap.add_argument("--name", default="default")
    ap.add_argument("--reference-world", type=int, default=0, help="0: a plain process")
    ap.add_argument("--dtype", default="float64", help="[model] dtype of every run (default: %(default)s)")
    ap.add_argument("--tolerance", type=float, help=f"default: {FLOAT64_BOUND:g} in float64")
    ap.add_argument("--weight-tolerance", type=float, help="weights by ||a - b|| / ||b|| instead of max-abs")
    ap.add_argument("--weights-by-norm", action="store_true", help="weights by ||a - b|| / ||b|| instead of max-abs")
    ap.add_argument("--floor-world", type=int, help="measure the noise floor at this world with the reference settings")
    ap.add_argument("--floor-factor", type=float, default=10.0)
    ap.add_argument("--floor-limit", type=float, help="the largest gap the floor run may itself show")
    ap.add_argument("--metric", action="append", default=[], dest="metrics")
    ap.add_argument("--expect-log", help="text every run's log must hold")
    args = ap.parse_args()
    if args.tolerance is None and args.floor_world is None:
        if args.dtype != "float64":
            ap.error(f"--dtype {args.dtype} needs --tolerance or --floor-world")
        args.tolerance = FLOAT64_BOUND
    args.sets.insert(0, f'model.dtype="{args.dtype}"')
    return args


def main():
    args = parse_args()
    subprocess.run(["bash", "scripts/make_corpus.sh"], check=True, capture_output=True)
    base = os.path.join(WORK, "fsdp", args.name)
    ref_losses, ref_evals, ref_figures, ref_weights = run(os.path.join(base, "single"), args.reference_world,
                                                         args.sets + args.reference_sets, args.metrics, args.expect_log)
    by_norm = args.weights_by_norm or bool(args.weight_tolerance)

    def gaps(losses, evals, figures, weights):
        # held-out losses and the further figures too
        loss_err = max_relative(losses + evals + figures, ref_losses + ref_evals + ref_figures)
        return (loss_err, *weight_difference(weights, ref_weights, by_norm=by_norm))

    loss_bound, weight_bound = args.tolerance, args.weight_tolerance or args.tolerance
    if args.floor_world:
        floor = run(os.path.join(base, f"floor{args.floor_world}"), args.floor_world, args.sets + args.reference_sets,
                    args.metrics)
        floor_loss, floor_weight, _ = gaps(*floor)
        fp32_eps = 1.1920929e-07
        loss_bound = args.floor_factor * max(floor_loss, fp32_eps)
        weight_bound = args.floor_factor * max(floor_weight, fp32_eps)
        print(f"noise floor ({args.name}): the reference at world {args.floor_world} differs from it by "
              f"{floor_loss:.2e} in losses and {floor_weight:.2e} in weights; bounds x{args.floor_factor:g}: "
              f"{loss_bound:.2e} and {weight_bound:.2e}")
        if args.floor_limit and max(floor_loss, floor_weight) >= args.floor_limit:
            sys.exit(f"FAIL: the noise floor ({args.name}) at world {args.floor_world} exceeds {args.floor_limit:g}: "
                     "more than rounding")
    failures = 0
    for world in args.worlds:
        losses, evals, figures, weights = run(os.path.join(base, f"world{world}"), world, args.sets + args.tested_sets,
                                              args.metrics, args.expect_log)
        loss_err, weight_err, worst = gaps(losses, evals, figures, weights)
        ok = len(losses) == len(ref_losses) and len(evals) == len(ref_evals) and loss_err <= loss_bound \
            and weight_err <= weight_bound and weights.keys() == ref_weights.keys()
        failures += not ok
        also = f" (and {', '.join(args.metrics)})" if args.metrics else ""
        print(f"{'ok  ' if ok else 'FAIL'} world {world} {args.name}: {len(losses)} steps, {len(evals)} evaluations, max relative loss "
              f"difference{also} {loss_err:.2e}, max relative weight difference {weight_err:.2e} ({worst}); "
              f"final loss {losses[-1]:.6f} vs one process {ref_losses[-1]:.6f}")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
