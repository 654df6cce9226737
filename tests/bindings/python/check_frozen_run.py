"""A frozen Run is an RL loop's reference model beside the Run it trains.

Over the llama_untied fixture (made by transformers), in float64:
- at world 1: a frozen Run of the actor's own run file gives the actor's log-probabilities
  bitwise before training; after two steps of a loss with a KL term to it, its log-probabilities
  are bitwise what they were and the actor's have moved; its outputs carry no gradient; it is in
  eval() mode; step, save and load raise fsdpp.Error naming the frozen run, zero_grad and an
  offload round trip work; its full weights are the fixture's; it reads no [checkpoint] resume,
  writes no out_dir, and takes a checkpoint named as its [model] path;
- its plan keeps no gradients or optimizer state, and holds each weight in its compute dtype:
  under param_dtype bfloat16 its full weights are the fixture's rounded to bfloat16, where the
  trained run's masters keep them whole;
- a frozen Qwen3-MoE forwards twice with autograd on and no backward between (the trained run
  refuses that: its load-balancing gradient waits for a backward);
- at world 2 under torchrun, with shard_size = "auto" (the policy sees ctx.training false and
  keeps the small model whole on each rank): the reference's log-probabilities and the actor's
  KL-regularised steps equal world 1's.

usage: check_frozen_run.py FIXTURE_DIR WORK_DIR
"""
import json
import os
import re
import sys
import tempfile

import torch

from check_python_run import ROWS, batches, fresh_dir, refusal, run_ranks, write_run_file

FUSED = {"policy.options.fused_linear_logprob": True}
KL_WEIGHT = 0.5
WORLD2_BOUND = 1e-10  # float64, world 2 against world 1


def kl_steps(actor, ref, rank, world, steps=2):
    """`steps` updates of the actor on its rows: minus the mean log-probability plus KL_WEIGHT
    times the k3 estimate of KL(actor || reference). Returns (reference log-probs before, the
    same after, actor log-probs before, after, grad norms)."""
    per_rank = ROWS // world
    rows = [ids[rank * per_rank:(rank + 1) * per_rank] for ids, _, _ in batches(101)[:steps]]
    with torch.no_grad():
        ref_before = ref.model.logprobs(rows[0][:, :-1], rows[0][:, 1:])
        actor_before = actor.model.logprobs(rows[0][:, :-1], rows[0][:, 1:])
    norms = []
    for mine in rows:
        with torch.no_grad():
            ref_logp = ref.model.logprobs(mine[:, :-1], mine[:, 1:])
        logp = actor.model.logprobs(mine[:, :-1], mine[:, 1:])
        log_ratio = ref_logp - logp
        kl = (log_ratio.exp() - log_ratio - 1).mean()
        (-logp.mean() + KL_WEIGHT * kl).backward()
        norm, stepped = actor.step()
        assert stepped
        actor.zero_grad()
        norms.append(norm)
    with torch.no_grad():
        ref_after = ref.model.logprobs(rows[0][:, :-1], rows[0][:, 1:])
        actor_after = actor.model.logprobs(rows[0][:, :-1], rows[0][:, 1:])
    return ref_before, ref_after, actor_before, actor_after, norms


def stderr_of(build):
    """What the engine logs to the process's stderr while `build()` runs, and its result."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+") as captured:
        os.dup2(captured.fileno(), 2)
        try:
            result = build()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        captured.seek(0)
        return captured.read(), result


def fixture_weights(model_dir):
    from safetensors.torch import load_file
    return {name: t.to(torch.float64) for name, t in load_file(os.path.join(model_dir, "model.safetensors")).items()}


def world1_checks(fixtures, work):
    import fsdpp
    model_dir = os.path.join(fixtures, "llama_untied")
    run_file = write_run_file(work, model_dir)
    actor = fsdpp.Run(run_file, FUSED)
    log, ref = stderr_of(lambda: fsdpp.Run(run_file, FUSED, frozen=True))
    checks = [("the frozen run says so, is in eval() mode, and the trained one is not",
               ref.frozen and not ref.model.training and not actor.frozen and actor.model.training),
              ("the frozen run's plan keeps no gradients or optimizer state",
               "gradients 0 B, optimizer state 0 B" in log)]
    ids = batches(101)[0][0]
    checks.append(("its outputs carry no gradient, with autograd on", not ref.model(ids).requires_grad))

    ref_before, ref_after, actor_before, actor_after, norms = kl_steps(actor, ref, 0, 1)
    checks += [("before training, its log-probabilities are the actor's, bitwise", torch.equal(ref_before, actor_before)),
               ("after two KL-regularised steps, its own are as they were, bitwise", torch.equal(ref_before, ref_after)),
               ("and the actor's have moved", (actor_after - actor_before).abs().max().item() > 1e-3)]

    saved = actor.save(os.path.join(work, "saves"))
    frozen = "the run is frozen (a reference model): its weights stay as [model] path gave them"
    errors = {"step": refusal(ref.step), "save": refusal(lambda: ref.save(os.path.join(work, "ref-saves"))),
              "load": refusal(lambda: ref.load(saved))}
    checks.append(("step, save and load of the frozen run raise, naming it",
                   all(errors[call] == f"{call}: {frozen}, and it neither steps, saves nor loads" for call in errors)))
    ref.zero_grad()
    ref.offload()
    refused_offloaded = refusal(lambda: ref.model(ids))
    ref.reload()
    with torch.no_grad():
        reloaded = ref.model.logprobs(ids[:, :-1], ids[:, 1:])
        again = ref.model.logprobs(ids[:, :-1], ids[:, 1:])
    checks.append(("zero_grad works; offload() refuses a forward until reload(), after which it is bitwise the same",
                   refused_offloaded != "no error" and torch.equal(reloaded, again)))

    originals = fixture_weights(model_dir)
    weights = {name: t.clone() for name, t in ref.full_weights(dtype=torch.float64)}
    checks.append(("its full weights are the fixture's",
                   weights.keys() == originals.keys() and all(torch.equal(weights[n], originals[n]) for n in weights)))
    resumed = fsdpp.Run(run_file, {**FUSED, "checkpoint.resume": saved}, frozen=True)
    resumed_weights = dict(resumed.full_weights(dtype=torch.float64))
    checks.append(("a [checkpoint] resume is not read: the frozen run's weights stay [model] path's",
                   all(torch.equal(resumed_weights[n], originals[n]) for n in originals)))
    from_checkpoint = fsdpp.Run(run_file, {**FUSED, "model.path": saved}, frozen=True)
    trained = dict(actor.full_weights(dtype=torch.float64))
    checks.append(("a checkpoint as its [model] path gives the trained weights",
                   all(torch.equal(dict(from_checkpoint.full_weights(dtype=torch.float64))[n], trained[n])
                       for n in trained)))
    # A LoRA run's checkpoint holds its adapters alone and records its base, which a run over
    # it, frozen or trained, takes its base from.
    lora = {**FUSED, "policy.options.lora_rank": 4, "train.out_dir": os.path.join(work, "lora-out")}
    adapted = fsdpp.Run(run_file, lora)
    adapted.model(ids[:, :-1]).logsumexp(-1).mean().backward()
    adapted.step()
    lora_saved = adapted.save(os.path.join(work, "lora-saves"))
    lora_weights = dict(adapted.full_weights(dtype=torch.float64))
    same = []
    for frozen in (True, False):
        over = fsdpp.Run(run_file, {**lora, "model.path": lora_saved}, frozen=frozen)
        same.append(all(torch.equal(w, lora_weights[n]) for n, w in over.full_weights(dtype=torch.float64)))
    checks.append(("a LoRA checkpoint as [model] path, frozen and trained, gives its merged weights", all(same)))
    untouched = os.path.join(work, "never-made")
    fsdpp.Run(run_file, {**FUSED, "train.out_dir": untouched}, frozen=True)
    checks.append(("a frozen run makes no out_dir", not os.path.exists(untouched)))
    return checks, norms


def compute_dtype_checks(fixtures, work):
    import fsdpp
    model_dir = os.path.join(fixtures, "llama_untied")
    run_file = write_run_file(work, model_dir, dtype="float32")
    bf16 = {"policy.options.param_dtype": "bfloat16"}
    originals = fixture_weights(model_dir)
    frozen = dict(fsdpp.Run(run_file, bf16, frozen=True).full_weights(dtype=torch.float64))
    masters = dict(fsdpp.Run(run_file, {**bf16, "train.out_dir": os.path.join(work, "bf16")}).full_weights(
        dtype=torch.float64))
    rounded = all(torch.equal(frozen[n], originals[n].to(torch.bfloat16).to(torch.float64)) for n in originals)
    some_moved = any(not torch.equal(frozen[n], originals[n]) for n in originals)
    whole = all(torch.equal(masters[n], originals[n]) for n in originals)
    return [("under param_dtype bfloat16 the frozen run holds its weights in bfloat16, the trained one's masters whole",
             rounded and some_moved and whole)]


def moe_checks(fixtures, work):
    import fsdpp
    run_file = write_run_file(work, os.path.join(fixtures, "qwen3_moe"), dtype="float32")
    ids = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(3))
    ref = fsdpp.Run(run_file, {"train.out_dir": os.path.join(work, "moe")}, frozen=True)
    first, second = ref.model(ids), ref.model(ids)
    actor = fsdpp.Run(run_file, {"train.out_dir": os.path.join(work, "moe")})
    kept = actor.model(ids)  # its backward still to come
    refused = refusal(lambda: actor.model(ids))
    return [("a frozen MoE forwards twice with autograd on and no backward (the trained one refuses)",
             torch.equal(first, second) and kept.requires_grad and "before the backward of the previous one" in refused)]


def rank_main(run_file, work):
    import fsdpp
    rank = int(os.environ["RANK"])
    actor = fsdpp.Run(run_file, FUSED)
    ref = fsdpp.Run(run_file, {**FUSED, "policy.options.shard_size": "auto"}, frozen=True)
    ref_before, _, _, _, norms = kl_steps(actor, ref, rank, 2)
    json.dump({"ref": ref_before.tolist(), "norms": norms}, open(os.path.join(work, f"world2.{rank}"), "w"))


def world2_checks(work, world1_ref, world1_norms):
    run_file = os.path.join(work, "run.toml")
    done = run_ranks(__file__, 2, run_file, work)
    if done.returncode != 0:
        print(done.stdout + done.stderr)
        return [("world 2 ran", False)]
    got = [json.load(open(os.path.join(work, f"world2.{r}"))) for r in range(2)]
    ref = torch.tensor(got[0]["ref"] + got[1]["ref"], dtype=torch.float64)
    norms = torch.tensor(got[0]["norms"], dtype=torch.float64)
    # Its plan's line: every one of the model's float64 parameters held on each rank.
    count = re.search(r"reading its rows, (\d+) parameters", done.stderr)
    frozen_plan = re.search(r"per rank: parameters (\d+) B, gradients 0 B, optimizer state 0 B", done.stderr)
    kept_whole = bool(count and frozen_plan) and int(frozen_plan.group(1)) == 8 * int(count.group(1))
    return [("at world 2, shard_size \"auto\" keeps the frozen model whole on each rank", kept_whole),
            ("at world 2 the reference's log-probabilities are world 1's",
             (ref - world1_ref).abs().max().item() <= WORLD2_BOUND),
            ("and the actor's KL-regularised steps too, on both ranks",
             got[0]["norms"] == got[1]["norms"] and
             (norms - torch.tensor(world1_norms, dtype=torch.float64)).abs().max().item() <= WORLD2_BOUND)]


def main():
    if sys.argv[1] == "--rank":
        rank_main(sys.argv[2], sys.argv[3])
        return 0
    import fsdpp
    fixtures, work = sys.argv[1], sys.argv[2]
    fresh_dir(work)
    os.makedirs(os.path.join(work, "world1"))
    checks, norms = world1_checks(fixtures, os.path.join(work, "world1"))
    ids = batches(101)[0][0]
    with torch.no_grad():
        world1_ref = fsdpp.Run(os.path.join(work, "world1", "run.toml"), FUSED, frozen=True).model.logprobs(
            ids[:, :-1], ids[:, 1:])
    for part, run in (("bf16", compute_dtype_checks), ("moe", moe_checks)):
        os.makedirs(os.path.join(work, part))
        checks += run(fixtures, os.path.join(work, part))
    world2 = os.path.join(work, "world2")
    os.makedirs(world2)
    write_run_file(world2, os.path.join(fixtures, "llama_untied"))
    checks += world2_checks(world2, world1_ref, norms)
    for name, ok in checks:
        print(f"{'ok  ' if ok else 'FAIL'} {name}")
    return 0 if all(ok for _, ok in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
