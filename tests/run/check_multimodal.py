"""Vision towers never hang and stay exact under FSDP. A tiny fresh Qwen2-VL (and Qwen2.5-VL)
trains 4 steps on a multimodal dataset whose global batches pair, at world 2, a text-only
rank 0 with an image on rank 1, then images plus a video on rank 0 with text on rank 1. For
each vision_tower mode (shard, root, replicate) the world-2 run must finish (a hang fails
at the timeout) with the losses, the global gradient norm of every step and the final
weights of one process over the same global batches, within compare.FLOAT64_BOUND (the
models run in float64). The gradient norms catch what the weights alone would not: Adam's
update barely changes when every gradient is scaled alike.

Adam's eps is 1e-4 here: the k-projection biases get gradients near zero (a bias added to
every key shifts all of a query's scores alike, which softmax cancels but for RoPE's
rotation), and Adam's first steps, about lr * g / (|g| + eps), magnify the rounding of
summing those gradients in another order most where |g| is near eps."""
import json
import os
import shutil
import subprocess
import sys

import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from compare import FLOAT64_BOUND, max_relative, weight_difference  # noqa: E402
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts"))
import cpu_cap  # noqa: E402

cpu_cap.apply()  # before any torch kernel runs

FSDPP = os.environ["FSDPP"]
WORK = os.path.join(os.environ["WORK"], "multimodal")
CONFIG = "tests/assets/fsdp-llama.toml"
IMAGE, VIDEO, START, END = 290, 291, 292, 293
PATCH_WIDTH = 3 * 2 * 4 * 4  # channels x frames per patch x patch side^2 of the tiny models


def make_dataset(directory):
    """Samples in the order text, image, image + video, text, twice: with batch size 2 and no
    shuffling, rank 0 of 2 gets text then image + video while rank 1 gets image then text."""
    gen = torch.Generator().manual_seed(5)
    pixels, lines = {}, []

    def text(n):
        return torch.randint(0, IMAGE, (n,), generator=gen).tolist()

    def visual(kind, key, grid):
        t, h, w = grid
        pixels[key] = torch.randn(t * h * w, PATCH_WIDTH, generator=gen)
        return [START] + [IMAGE if kind == "image" else VIDEO] * (t * h * w // 4) + [END], {"pixels": key, "grid": grid}

    for cycle in range(2):
        lines.append({"input_ids": text(20)})
        ids, image = visual("image", f"c{cycle}i", [1, 4, 6])
        lines.append({"input_ids": text(5) + ids + text(6), "images": [image]})
        ids_i, image = visual("image", f"c{cycle}ii", [1, 2, 2])
        ids_v, video = visual("video", f"c{cycle}v", [2, 4, 4])
        video["seconds_per_grid"] = 2.0
        lines.append({"input_ids": text(3) + ids_i + text(2) + ids_v + text(4), "images": [image], "videos": [video]})
        lines.append({"input_ids": text(30)})
    os.makedirs(directory, exist_ok=True)
    save_file(pixels, os.path.join(directory, "pixels.safetensors"))
    with open(os.path.join(directory, "samples.jsonl"), "w") as f:
        for line in lines:
            f.write(json.dumps(line) + "\n")


def train(out_dir, model, data, world, sets):
    args = ["train", CONFIG, "--set", f'train.out_dir="{out_dir}"', "--set", f'model.path="{model}"',
            "--set", f'data.train="{data}"', "--set", "data.seq_len=40", "--set", "data.batch_size=2",
            "--set", "data.shuffle=false", "--set", "train.steps=4", "--set", "optimizer.eps=1e-4",
            "--set", 'model.dtype="float64"'] + [a for s in sets for a in ("--set", s)]
    cmd = [FSDPP] + args if world == 1 else [FSDPP, "launch", "--nproc-per-node", str(world), "--"] + args
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    except subprocess.TimeoutExpired:
        sys.exit(f"FAIL: {' '.join(cmd)} did not finish in 180 s (a hang)")
    if proc.returncode != 0:
        sys.exit(f"FAIL: {' '.join(cmd)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    with open(os.path.join(out_dir, "train.log"), "w") as f:
        f.write(proc.stderr)
    steps = [json.loads(l) for l in open(os.path.join(out_dir, "metrics.jsonl")) if '"loss"' in l]
    return [s["loss"] for s in steps], [s["grad_norm"] for s in steps], \
        load_file(os.path.join(out_dir, "model", "model.safetensors"))


def held_out_and_resume(data):
    """[data] eval_fraction holds out a dataset's last samples: 2 of 8 here (an image + video
    sample and a text one). The evaluations during training give at world 2 the world-1
    figures, and the last one (after the last step) the figure fsdpp eval gives of the export.
    A resume whose samples.jsonl was rewritten since its checkpoint is refused."""
    model = "tests/assets/models/tiny-qwen2-vl"
    held = ["data.eval_fraction=0.25", "train.eval_every=2"]
    evals, epochs = {}, {}
    for world in (1, 2):
        out = os.path.join(WORK, "held-out", f"world-{world}")
        train(out, model, data, world, held)
        evals[world] = [json.loads(l)["eval_loss"] for l in open(os.path.join(out, "metrics.jsonl")) if "eval_loss" in l]
        # The epoch the order draws from holds the 6 samples that train, none held out.
        epochs[world] = "6 samples per epoch" in open(os.path.join(out, "train.log")).read()
    export = os.path.join(WORK, "held-out", "world-1", "model")
    proc = subprocess.run([FSDPP, "eval", CONFIG, "--json", "--set", f'model.path="{export}"', "--set", f'data.train="{data}"',
                           "--set", "data.seq_len=40", "--set", "data.batch_size=2", "--set", "data.eval_fraction=0.25",
                           "--set", 'model.dtype="float64"'],
                          capture_output=True, text=True, timeout=180)
    exported = json.loads(proc.stdout)["loss"] if proc.returncode == 0 else float("nan")
    ok = all(epochs.values()) and len(evals[1]) == 2 and max_relative(evals[2], evals[1]) < FLOAT64_BOUND and \
        abs(exported - evals[1][-1]) <= FLOAT64_BOUND * abs(evals[1][-1])
    print(f"{'ok  ' if ok else 'FAIL'} held-out samples: 6 of 8 train ({epochs}); evaluations {evals[1]} at world 1, "
          f"{evals[2]} at world 2; "
          f"fsdpp eval of the export {exported}" + ("" if proc.returncode == 0 else f" ({proc.stderr.strip()[-300:]})"))

    rewritten = os.path.join(WORK, "rewritten")
    shutil.copytree(data, rewritten)
    out = os.path.join(WORK, "held-out", "resumed")
    train(out, model, rewritten, 1, ["checkpoint.save_every=2"])
    lines = open(os.path.join(rewritten, "samples.jsonl")).readlines()
    open(os.path.join(rewritten, "samples.jsonl"), "w").writelines(lines[::-1])
    args = ["train", CONFIG, "--set", f'train.out_dir="{out}"', "--set", f'model.path="{model}"', "--set",
            f'data.train="{rewritten}"', "--set", "data.seq_len=40", "--set", "data.batch_size=2", "--set",
            "data.shuffle=false", "--set", "train.steps=6", "--set", "optimizer.eps=1e-4", "--set", 'model.dtype="float64"',
            "--set", 'checkpoint.resume="latest"']
    proc = subprocess.run([FSDPP] + args, capture_output=True, text=True, timeout=180)
    refused = proc.returncode == 2 and "samples.jsonl" in proc.stderr and "changed since the checkpoint" in proc.stderr
    print(f"{'ok  ' if refused else 'FAIL'} a rewritten samples.jsonl is refused on resume: "
          f"exit {proc.returncode}: {proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else ''}")
    return ok and refused


def main():
    shutil.rmtree(WORK, ignore_errors=True)
    data = os.path.join(WORK, "data")
    make_dataset(data)
    ok = True
    for model in ("tests/assets/models/tiny-qwen2-vl", "tests/assets/models/tiny-qwen2_5-vl"):
        name = os.path.basename(model)
        ref_losses, ref_norms, ref_weights = train(os.path.join(WORK, name, "one"), model, data, 1, [])
        for mode in ("shard", "root", "replicate"):
            losses, norms, weights = train(os.path.join(WORK, name, mode), model, data, 2,
                                           [f'policy.options.vision_tower="{mode}"'])
            loss_err, norm_err = max_relative(losses, ref_losses), max_relative(norms, ref_norms)
            weight_err, worst = weight_difference(weights, ref_weights)
            good = len(losses) == len(ref_losses) == 4 and max(loss_err, norm_err, weight_err) < FLOAT64_BOUND \
                and weights.keys() == ref_weights.keys()
            ok &= good
            print(f"{'ok  ' if good else 'FAIL'} {name} vision_tower {mode} at world 2: losses "
                  f"{', '.join(f'{l:.4f}' for l in losses)}; max relative difference: losses {loss_err:.2e}, "
                  f"gradient norms {norm_err:.2e}, weights {weight_err:.2e} ({worst})")
    ok &= held_out_and_resume(data)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
