"""float16 compute with a dynamic loss scale, against PyTorch's ShardedGradScaler.

The same Llama, initial weights (saved by transformers), batches and AdamW, float16 compute
over float32 masters, at world 2 over gloo: fsdpp with [loss_scale] against transformers +
fully_shard + ShardedGradScaler with the same settings (scripts/fsdp_peer.py). The scale
starts high enough that the first steps overflow, and grows every few finite steps:
- every step's scale and whether it was skipped are the same in both;
- every step's loss, and the gradient norm of every step taken (the scale divided out),
  agree within 1e-2 relative (float16 kernels round apart: measured 4e-4);
- the same run driven from Python at world 1 (fsdpp.Run, a cross-entropy the loop computes
  and does not scale) takes the scales and skips of `fsdpp train` at world 1, its losses and
  norms within the same bound (measured: bitwise);
- resumed from the checkpoint of step 8, the run's last 8 steps are bitwise those of the
  run that went on, scales and skips included; resumed at world 1, its first step takes the
  scale the world-2 run took (where later steps overflow depends on the world size: each
  rank's float16 gradients sum its own rows before the reduction).

usage: check_loss_scale.py FSDPP WORK_DIR
"""
import json
import os
import shutil
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "scripts"))
from bench_common import WindowSampler, read_tokens, read_toml, write_initial_model  # noqa: E402

STEPS, STOP = 16, 8
BOUND = 1e-2
RUN = f"""[model]
path = "tests/assets/models/fsdp-llama"
init_seed = 11
[data]
train = "data/licenses.tok"
seq_len = 32
batch_size = 12
shuffle = false
[optimizer]
lr = 1e-2
weight_decay = 0.1
beta2 = 0.95
# Constant: a skipped step advances the binary's schedule but not run.step()'s count.
[scheduler]
kind = "constant"
[loss_scale]
init_scale = 1099511627776  # 2^40: a power of 2, exact in the peer's float32 scale too
backoff_factor = 0.25
growth_interval = 3
[train]
steps = {STEPS}
clip_grad_norm = 1.0
threads = 1
[policy.options]
param_dtype = "float16"
"""


def records(path):
    return [json.loads(line) for line in open(path)]


def run_fsdpp(fsdpp, toml, init_dir, out, world, extra=()):
    sets = [f'model.path="{init_dir}"', f'train.out_dir="{out}"', 'metrics.progress="never"',
            "checkpoint.save_final=false", *extra]
    cmd = [fsdpp, "launch", "--nproc-per-node", str(world), "--", "train", toml]
    for s in sets:
        cmd += ["--set", s]
    subprocess.run(cmd, check=True, timeout=600, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   env={**os.environ, "OMP_NUM_THREADS": "1"})
    return records(os.path.join(out, "metrics.jsonl"))


def run_peer(toml, init_dir, out):
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    subprocess.run([torchrun, "--standalone", "--nproc-per-node", "2", os.path.join(REPO, "scripts", "bench_fsdp.py"),
                    "--torch-worker", "--config", toml, "--steps", str(STEPS), "--threads", "1", "--out-dir", out,
                    "--init-dir", init_dir, "--device", "cpu", "--param-dtype", "float16"],
                   check=True, timeout=600, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   env={**os.environ, "OMP_NUM_THREADS": "1"})
    return records(os.path.join(out, "metrics.jsonl"))


def python_loop(toml, init_dir, out):
    """The same run driven from Python at world 1: the binary's batches (windows in file
    order), a cross-entropy the loop computes from run.model's logits, not scaled by the
    loop; metrics.jsonl-like records of each step."""
    import torch
    import fsdpp
    run = fsdpp.Run(toml, {"model.path": init_dir, "train.out_dir": out})
    tokens, _ = read_tokens("data/licenses.tok")
    sampler = WindowSampler(tokens, 32)
    recs = []
    for _ in range(STEPS):
        window = torch.from_numpy(sampler.take(12))  # [12, 33]
        scale = run.loss_scale
        logits = run.model(window[:, :-1]).div_(1.0)  # changed in place, as a loop's temperature does
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), window[:, 1:].reshape(-1))
        loss.backward()
        norm, stepped = run.step()
        run.zero_grad()
        recs.append({"loss": loss.item(), "loss_scale": scale, "grad_norm": norm, "skipped": not stepped})
    return recs


def trajectory(recs):
    return [(r["loss_scale"], bool(r.get("skipped"))) for r in recs]


def compare(name, got, want):
    same = trajectory(got) == trajectory(want)
    pairs = [(a["loss"], b["loss"]) for a, b in zip(got, want)]
    pairs += [(a["grad_norm"], b["grad_norm"]) for a, b in zip(got, want) if not b.get("skipped")]
    gap = max(abs(a - b) / abs(b) for a, b in pairs)
    skipped = sum(s for _, s in trajectory(want))
    ok = same and len(got) == len(want) and gap <= BOUND
    print(f"{'ok  ' if ok else 'FAIL'} {name}: scales {' '.join(f'{s:g}' + ('*' if k else '') for s, k in trajectory(got))} "
          f"({'the same' if same else 'NOT the same'}; * skipped, {skipped} of {len(want)}); losses "
          f"{got[0]['loss']:.4f} .. {got[-1]['loss']:.4f} and the steps' gradient norms {gap:.1e} apart "
          f"(bound {BOUND:g})")
    return ok


def main():
    if sys.argv[1] == "--python-loop":
        json.dump(python_loop(*sys.argv[2:5]), open(sys.argv[5], "w"))
        return 0
    fsdpp, work = sys.argv[1], sys.argv[2]
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    os.chdir(REPO)
    subprocess.run(["bash", "scripts/make_corpus.sh"], check=True, stdout=subprocess.DEVNULL)
    toml = os.path.join(work, "fp16.toml")
    open(toml, "w").write(RUN)
    init_dir, _, _ = write_initial_model(read_toml(toml), os.path.join(work, "initial-model"))
    ours = run_fsdpp(fsdpp, toml, init_dir, os.path.join(work, "fsdpp"), 2, [f"checkpoint.save_every={STOP}"])
    peer = run_peer(toml, init_dir, os.path.join(work, "peer"))
    ok = compare("fsdpp against ShardedGradScaler, world 2", ours, peer)
    saved = os.path.join(work, "fsdpp", "checkpoints", f"step-{STOP:08d}")
    resumed = run_fsdpp(fsdpp, toml, init_dir, os.path.join(work, "resumed"), 2, [f'checkpoint.resume="{saved}"'])
    same = [(r["loss"], r["loss_scale"], r.get("skipped")) for r in resumed] == \
           [(r["loss"], r["loss_scale"], r.get("skipped")) for r in ours[STOP:]]
    ok &= same
    print(f"{'ok  ' if same else 'FAIL'} resumed from the checkpoint of step {STOP}: steps {STOP + 1}..{STOP + len(resumed)}"
          f" {'bitwise' if same else 'NOT'} as the run that went on, losses, scales and skips")
    one_process = run_fsdpp(fsdpp, toml, init_dir, os.path.join(work, "world-1"), 1)
    looped = os.path.join(work, "python.json")
    subprocess.run([sys.executable, __file__, "--python-loop", toml, init_dir, os.path.join(work, "python"), looped],
                   check=True, timeout=600, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   env={**os.environ, "OMP_NUM_THREADS": "1"})
    ok &= compare("fsdpp.Run from Python, its loss unscaled, against fsdpp train, world 1", json.load(open(looped)),
                  one_process)
    # At another world size each rank's float16 gradients sum other rows before the reduction,
    # so where they overflow differs; the scale the checkpoint carries is what must hold.
    one = run_fsdpp(fsdpp, toml, init_dir, os.path.join(work, "resumed-1"), 1, [f'checkpoint.resume="{saved}"'])
    carried = one[0]["loss_scale"] == ours[STOP]["loss_scale"]
    ok &= carried
    print(f"{'ok  ' if carried else 'FAIL'} resumed at world 1: step {STOP + 1} scales its loss by "
          f"{one[0]['loss_scale']:g}, the world-2 run's {ours[STOP]['loss_scale']:g}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
