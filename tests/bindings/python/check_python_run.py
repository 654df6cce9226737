"""fsdpp.Run driven from Python, against transformers + torch.optim.AdamW in one process.

The same model (transformers-saved Llamas, untied and tied), the same rows and the same
Python loss, for 5 steps in float64, at world 1 (in this process) and world 2 (two processes
started by torchrun, each rank taking half of every batch, gradients averaged over the
ranks). Losses as RL loops write them: a clipped ratio on log-probabilities taken from
run.model's logits, a DPO-style margin on run.model.logprobs (chunked, at a temperature),
and a clipped ratio less an entropy bonus, both from logprobs(..., entropy=True), which the
reference takes from log_softmax of its full logits.
- Against transformers: the first step's loss and gradient norm within 1e-6 relative
  (transformers computes its rotary tables in float32 whatever the model's dtype), and each
  later step's loss within 1e-3 relative: AdamW moves a weight by about the learning rate
  whatever its gradient's size, so the tables' rounding grows over steps, while a wrong
  learning rate, sign or average moves the second step's loss by 1e-1.
- World 2 against world 1: losses, gradient norms and the full weights within 1e-10, and
  full_weights names every weight of the transformers model (its tied lm_head aside).
[optimizer] host_update = "overlapped" gives bitwise the figures, weights and checkpoint of
updates in the step. A forward's graph outlives a dropped Run and a step or an offload before
its backward; threads share a Run; a save one rank cannot make fails on both ranks at once.
Then the bad uses: each raises one fsdpp.Error naming what is wrong, and the interpreter
lives on.

usage: check_python_run.py FIXTURE_DIR WORK_DIR
"""
import json
import math
import os
import shutil
import subprocess
import sys

import numpy as np
import torch

STEPS, ROWS, TOKENS = 5, 4, 12
FIRST_STEP_BOUND, LATER_STEPS_BOUND = 1e-6, 1e-3  # relative, against transformers
FLOAT64_BOUND = 1e-10                             # world 2 against world 1
TEMPERATURE = 0.9


def write_run_file(work, model_dir, dtype="float64", lr=1e-2):
    path = os.path.join(work, "run.toml")
    with open(path, "w") as f:
        f.write(f"""[model]
path = "{model_dir}"
dtype = "{dtype}"
[optimizer]
lr = {lr}
weight_decay = 0.1
beta1 = 0.9
beta2 = 0.95
[scheduler]
kind = "constant"
[train]
steps = {STEPS}
clip_grad_norm = 1.0
threads = 1
out_dir = "{work}/out"
reuse_out_dir = true
""")
    return path


def fresh_dir(path):
    """`path` as an empty directory, whatever an earlier run left there."""
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)
    return path


def run_ranks(script, world, *args):
    """`script --rank ARGS...` as `world` ranks under torchrun, one thread each: the finished
    process, its output captured."""
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    return subprocess.run([torchrun, "--standalone", "--nproc-per-node", str(world), script, "--rank", *args],
                          timeout=300, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})


def batches(vocab):
    """Per step: token rows [ROWS, TOKENS + 1], advantages and old-log-prob offsets [ROWS, TOKENS]."""
    g = torch.Generator().manual_seed(7)
    return [(torch.randint(vocab, (ROWS, TOKENS + 1), generator=g),
             torch.randn(ROWS, TOKENS, generator=g, dtype=torch.float64),
             0.1 * torch.randn(ROWS, TOKENS, generator=g, dtype=torch.float64)) for _ in range(STEPS)]


def clipped_ratio_loss(logp, advantages, offsets):
    """PPO's clipped objective over every predicted token's log-prob [B, T]. The old log-probs
    are ln(1/101), a fresh model's over the fixtures' 101 tokens, moved by `offsets`: the
    ratios spread around 1, some clipped."""
    ratio = torch.exp(logp - (offsets - math.log(101)))
    return -torch.min(ratio * advantages, ratio.clamp(0.8, 1.2) * advantages).mean()


def margin_loss(logp, advantages, offsets):
    """DPO's loss over row pairs (chosen, rejected): the sequences' log-prob sums against a
    reference's, which the offsets stand for."""
    sums = (logp - offsets).sum(-1)  # [B]
    return -torch.nn.functional.logsigmoid(0.5 * (sums[0::2] - sums[1::2])).mean()


# loss name -> (loss, whether log-probs come from run.model.logprobs at TEMPERATURE)
LOSSES = {"clipped-ratio": (clipped_ratio_loss, False), "dpo-margin": (margin_loss, True),
          "ratio-entropy": (clipped_ratio_loss, True)}
# loss name -> the weight of the mean token entropy subtracted from it (an entropy bonus),
# from logprobs(..., entropy=True) in fsdpp and from the full logits in the reference.
ENTROPY_BONUS = {"ratio-entropy": 0.05}


def full_entropy(logits, temperature=1.0):
    log_p = torch.log_softmax(logits.double() / temperature, -1)  # [B, T, V]
    return -(log_p.exp() * log_p).sum(-1)  # [B, T]


def full_logprobs(logits, ids, temperature=1.0):
    return torch.log_softmax(logits.double() / temperature, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)  # [B, T]


def refusal(call):
    """What fsdpp.Error `call()` raised, or "no error"."""
    import fsdpp
    try:
        call()
    except fsdpp.Error as e:
        return str(e)
    return "no error"


def refusals_hold(cases):
    """Each (name, call, wanted) of `cases`: call() must raise fsdpp.Error saying `wanted`.
    Prints a line for each; whether all did."""
    ok = True
    for name, call, wanted in cases:
        said = refusal(call)
        ok &= wanted in said
        print(f"{'ok  ' if wanted in said else 'FAIL'} {name}: {said}")
    return ok


def refused_while_offloaded(run, call, what):
    """call() on `run` offloaded must raise fsdpp.Error naming offload; the run is reloaded after."""
    run.offload()
    said = refusal(call)
    run.reload()
    print(f"{'ok  ' if 'offload' in said else 'FAIL'} {what} while offloaded: {said}")
    return "offload" in said


def world_2_results(script, out, *args):
    """What each rank of `script --rank ARGS... OUT` under torchrun at world 2 saved to
    OUT.RANK.pt, or None (with a FAIL line) where it did not finish."""
    done = run_ranks(script, 2, *args, out)
    if done.returncode != 0:
        print(f"FAIL world 2 exited {done.returncode}: {done.stderr[-2000:]}")
        return None
    return [torch.load(f"{out}.{r}.pt") for r in range(2)]


def reference_step(model, optimizer, loss, losses, norms):
    """The reference loop's step: backward, clip_grad_norm_ to 1, AdamW, zero_grad; the loss
    and the gradient norm appended to `losses` and `norms`."""
    loss.backward()
    norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item())
    optimizer.step()
    optimizer.zero_grad()
    losses.append(loss.item())


def backward_and_step(run, loss, losses, norms):
    """A loop's step: backward, run.step() (which must apply the update), zero_grad; the loss
    and the gradient norm appended to `losses` and `norms`."""
    loss.backward()
    norm, stepped = run.step()
    assert stepped
    run.zero_grad()
    losses.append(loss.item())
    norms.append(norm)


def train_fsdpp(run_file, loss_name, rank, world, steps=range(STEPS), overrides=None, save=None, load=None):
    """This rank's ((losses, grad norms) over `steps`, full weights after them, the checkpoint
    saved after them under the directory `save` names), each rank taking its rows of every
    batch; with `load`, a checkpoint loaded into the built run first."""
    import fsdpp
    loss_of, chunked = LOSSES[loss_name]
    run = fsdpp.Run(run_file, {"policy.options.fused_linear_logprob": chunked, **(overrides or {})})
    if load:
        run.load(load)
    assert (run.rank, run.world_size, run.steps) == (rank, world, steps.start), (run.rank, run.world_size, run.steps)
    losses, norms = [], []
    per_rank = ROWS // world
    for ids, advantages, offsets in batches(run._run.vocab_size)[steps.start:steps.stop]:
        mine = ids[rank * per_rank:(rank + 1) * per_rank]
        bonus = ENTROPY_BONUS.get(loss_name)
        if bonus:
            logp, entropy = run.model.logprobs(mine[:, :-1], mine[:, 1:], temperature=TEMPERATURE, entropy=True)
        elif chunked:
            logp = run.model.logprobs(mine[:, :-1], mine[:, 1:], temperature=TEMPERATURE)
        else:
            logp = full_logprobs(run.model(mine[:, :-1]), mine)
        rows = slice(rank * per_rank, (rank + 1) * per_rank)
        loss = loss_of(logp, advantages[rows], offsets[rows])
        backward_and_step(run, loss - bonus * entropy.mean() if bonus else loss, losses, norms)
    assert run.steps == steps.stop
    # Every rank iterates: each unit's gather is a collective.
    weights = {name: t.clone() for name, t in run.full_weights(dtype=torch.float64)}
    return (losses, norms), weights, run.save(save) if save else None


def train_reference(model_dir, vocab, loss_name):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64)
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                                  lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    loss_of, chunked = LOSSES[loss_name]
    temperature = TEMPERATURE if chunked else 1.0
    losses, norms = [], []
    for ids, advantages, offsets in batches(vocab):
        # Two halves, each its own mean, averaged: what two ranks' averaged gradients give.
        halves = [slice(0, ROWS // 2), slice(ROWS // 2, ROWS)]
        bonus = ENTROPY_BONUS.get(loss_name, 0.0)
        loss = 0
        for h in halves:
            logits = model(ids[h, :-1]).logits
            loss = loss + (loss_of(full_logprobs(logits, ids[h], temperature), advantages[h], offsets[h]) -
                           bonus * full_entropy(logits, temperature).mean()) / 2
        reference_step(model, optimizer, loss, losses, norms)
    return (losses, norms), {name: t.detach() for name, t in model.state_dict().items()}


def relative_gap(a, b):
    return abs(a - b) / max(abs(b), 1e-12)


def compare_transformers(name, got, want):
    """(losses, norms) against transformers': the first step's both, the later losses."""
    (losses, norms), (want_losses, want_norms) = got, want
    first = max(relative_gap(losses[0], want_losses[0]), relative_gap(norms[0], want_norms[0]))
    later = max(relative_gap(a, b) for a, b in zip(losses[1:], want_losses[1:]))
    ok = first <= FIRST_STEP_BOUND and later <= LATER_STEPS_BOUND
    print(f"{'ok  ' if ok else 'FAIL'} {name}: losses {losses[0]:.6f} .. {losses[-1]:.6f}; against transformers, "
          f"first step {first:.1e} (bound {FIRST_STEP_BOUND:.0e}), later losses {later:.1e} "
          f"(bound {LATER_STEPS_BOUND:.0e}), relative")
    return ok


def compare_worlds(name, got, want):
    """(losses, norms) and full weights at world 2 against world 1's."""
    (figures, weights), (want_figures, want_weights) = got, want
    gap = max(max(abs(a - b) for a, b in zip(g, w)) for g, w in zip(figures, want_figures))
    same_names = set(weights) == set(want_weights)
    weight_gap = max((weights[k] - want_weights[k]).abs().max().item() for k in weights if k in want_weights)
    ok = same_names and max(gap, weight_gap) <= FLOAT64_BOUND
    print(f"{'ok  ' if ok else 'FAIL'} {name}: losses and norms {gap:.1e}, {len(weights)} full weights "
          f"{weight_gap:.1e} from world 1's (bound {FLOAT64_BOUND:.0e})")
    return ok


def compare_names(name, got, want):
    """full_weights' names against the transformers model's: a tied model's lm_head.weight is
    its embedding's, which the export leaves out too."""
    ok = set(got) <= set(want) and set(want) - set(got) <= {"lm_head.weight"}
    print(f"{'ok  ' if ok else 'FAIL'} {name}: full_weights names {len(got)} tensors, "
          f"{'each' if ok else 'NOT each'} a weight of the transformers model")
    return ok


def save_resume_export(run_file, loss_name, work, one, torchrun):
    """World 1 trains 3 steps and saves; fsdpp export of that checkpoint equals full_weights
    bitwise; a world-1 run resumed from it by its run file's [checkpoint] resume, and a world-2
    run that loads it with run.load, each train the last 2 steps and end where world 1 did in
    one go."""
    from safetensors.torch import load_file
    shutil.rmtree(os.path.join(work, "saved"), ignore_errors=True)  # a rerun's: save refuses a step saved already
    _, weights, saved = train_fsdpp(run_file, loss_name, 0, 1, steps=range(3), save=os.path.join(work, "saved"))
    placed = saved == os.path.join(work, "saved", "step-00000003")
    print(f"{'ok  ' if placed else 'FAIL'} {loss_name}: run.save(dir) returned {saved}")
    exported = os.path.join(work, "exported")
    subprocess.run([os.environ["FSDPP"], "export", saved, exported, "--dtype", "float64"], check=True, timeout=120,
                   stderr=subprocess.DEVNULL)
    export = load_file(os.path.join(exported, "model.safetensors"))
    same = set(export) == set(weights) and all(torch.equal(export[k], weights[k]) for k in weights)
    print(f"{'ok  ' if same else 'FAIL'} {loss_name}: fsdpp export of the step-3 checkpoint saved from Python "
          f"{'equals' if same else 'DIFFERS from'} full_weights, {len(export)} tensors")
    tail = (one[0][0][3:], one[0][1][3:])
    resumed = compare_worlds(f"{loss_name}, resumed at world 1 after 3 steps",
                             train_fsdpp(run_file, loss_name, 0, 1, range(3, STEPS), {"checkpoint.resume": saved})[:2],
                             (tail, one[1]))
    out = os.path.join(work, "loaded.json")
    subprocess.run([torchrun, "--standalone", "--nproc-per-node", "2", __file__, "--rank", run_file, loss_name, out,
                    saved], check=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    ranks = [json.load(open(f"{out}.{r}")) for r in range(2)]
    losses = [(a + b) / 2 for a, b in zip(ranks[0]["losses"], ranks[1]["losses"])]
    loaded = compare_worlds(f"{loss_name}, loaded by run.load at world 2 after 3 steps at world 1",
                            ((losses, ranks[0]["norms"]), torch.load(f"{out}.0.pt")), (tail, one[1]))
    return placed and same and resumed and loaded


def offload_round_trip(run_file):
    """A step, a backward, offload of everything, reload (twice: the second finds nothing to
    bring back), the step: bitwise what the same calls give with no offload between; and while
    offloaded, each use raises fsdpp.Error."""
    import fsdpp
    ids, advantages, offsets = batches(101)[0]

    def train(offload_between):
        run = fsdpp.Run(run_file)
        figures = []
        for step in range(2):
            loss = clipped_ratio_loss(full_logprobs(run.model(ids[:, :-1]), ids), advantages, offsets)
            loss.backward()  # the gradients are held across the offload
            if offload_between and step == 1:
                run.offload()
                refused = []
                for name, call in [("forward", lambda: run.model(ids)), ("step", run.step),
                                   ("full_weights", lambda: next(run.full_weights())), ("save", run.save),
                                   ("offload", run.offload)]:
                    try:
                        call()
                        refused.append(f"{name}: no error")
                    except fsdpp.Error as e:
                        refused.append(str(e))
                run.reload()
                run.reload()  # nothing is offloaded now: it does nothing
            figures.append((loss.item(),) + run.step())
            run.zero_grad()
        weights = {name: t.clone() for name, t in run.full_weights(dtype=torch.float64)}
        return figures, weights, refused if offload_between else None

    plain, plain_weights, _ = train(False)
    moved, moved_weights, refused = train(True)
    same = plain == moved and all(torch.equal(plain_weights[k], moved_weights[k]) for k in plain_weights)
    print(f"{'ok  ' if same else 'FAIL'} offload and reload between backward and step: the step and the weights "
          f"{'bitwise' if same else 'NOT'} as with no offload")
    expected = ["forward: offload() moved the run's params, grads, optimizer off the device; call reload() first",
                "step: offload() moved the run's params, grads, optimizer off the device; call reload() first",
                "full_weights: offload() moved the run's params, grads, optimizer off the device; call reload() first",
                "save: offload() moved the run's params, grads, optimizer off the device; call reload() first",
                "offload: offload() moved the run's params, grads, optimizer off the device already; reload() first"]
    ok = same
    for got, want in zip(refused, expected):
        good = got == want
        ok &= good
        print(f"{'ok  ' if good else 'FAIL'} while offloaded: {got}")
    return ok


def overlapped_host_update(run_file, loss_name, work):
    """[optimizer] host_update = "overlapped" (a host thread updates each unit while the next
    forward begins) against "in_step": over 3 steps, bitwise the same losses, norms and
    full_weights, and a checkpoint saved right after the last step with the same rows and
    moments; then offload() right after a step waits for its updates too."""
    import fsdpp
    from safetensors.torch import load_file
    got = {}
    for mode in ("in_step", "overlapped"):
        saved = os.path.join(work, f"host-update-{mode}")
        shutil.rmtree(saved, ignore_errors=True)
        figures, weights, step_dir = train_fsdpp(run_file, loss_name, 0, 1, steps=range(3),
                                                 overrides={"optimizer.host_update": mode}, save=saved)
        files = sorted(f for f in os.listdir(step_dir) if f.endswith(".safetensors"))
        got[mode] = figures, weights, {f: load_file(os.path.join(step_dir, f)) for f in files}
    (f1, w1, c1), (f2, w2, c2) = got["in_step"], got["overlapped"]
    same = f1 == f2 and w1.keys() == w2.keys() and all(torch.equal(w1[k], w2[k]) for k in w1)
    saved_same = bool(c1) and c1.keys() == c2.keys() and all(
        a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a) for a, b in zip(c1.values(), c2.values()))
    print(f"{'ok  ' if same else 'FAIL'} host_update overlapped: losses, norms and full_weights over 3 steps "
          f"{'bitwise' if same else 'NOT'} as in_step")
    print(f"{'ok  ' if saved_same else 'FAIL'} host_update overlapped: the checkpoint saved after step 3 "
          f"({len(c1)} rank file{'s' * (len(c1) != 1)}) {'bitwise' if saved_same else 'NOT'} as in_step's")
    ids, advantages, offsets = batches(101)[0]
    moved = {}
    for mode in ("in_step", "overlapped"):
        run = fsdpp.Run(run_file, {"optimizer.host_update": mode})
        clipped_ratio_loss(full_logprobs(run.model(ids[:, :-1]), ids), advantages, offsets).backward()
        run.step()
        run.offload()
        run.reload()
        moved[mode] = {name: t.clone() for name, t in run.full_weights(dtype=torch.float64)}
    offloaded = all(torch.equal(moved["in_step"][k], moved["overlapped"][k]) for k in moved["in_step"])
    print(f"{'ok  ' if offloaded else 'FAIL'} host_update overlapped: offload() and reload() right after a step "
          f"keep {'bitwise' if offloaded else 'NOT'} in_step's weights")
    return same and saved_same and offloaded


def chosen_positions(run_file, model_dir):
    """Logits and log-probabilities at positions the loop chose (a left-padded row's: its
    padding at 0, its tokens from 0; and a row starting at 40) equal transformers' given the
    same position_ids, within 1e-6 relative (its rotary tables are float32)."""
    import fsdpp
    from transformers import AutoModelForCausalLM
    run = fsdpp.Run(run_file, {"policy.options.fused_linear_logprob": True})
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64)
    ids = torch.randint(101, (2, TOKENS + 1), generator=torch.Generator().manual_seed(3))
    positions = torch.stack([torch.cat([torch.zeros(4, dtype=torch.long), torch.arange(TOKENS - 4)]),
                             torch.arange(40, 40 + TOKENS)])  # [2, T]
    want = reference(ids[:, :-1], position_ids=positions).logits.detach()
    got = run.model(ids[:, :-1], position_ids=positions).detach()
    logp = run.model.logprobs(ids[:, :-1], ids[:, 1:], position_ids=positions).detach()
    gap = max(((got - want).norm() / want.norm()).item(),
              ((logp - full_logprobs(want, ids)).norm() / full_logprobs(want, ids).norm()).item())
    ok = gap <= FIRST_STEP_BOUND
    print(f"{'ok  ' if ok else 'FAIL'} chosen position_ids: logits and logprobs {gap:.1e} from transformers' "
          f"(bound {FIRST_STEP_BOUND:.0e}, relative)")
    return ok


def ignored_targets(run_file):
    """Targets of IGNORE_INDEX (-100, transformers' ignored labels) give a log-probability of 0
    and no gradient: the logprobs, and the gradient norm a step reports, equal those of
    log_softmax over the full logits with those positions left out, within 1e-6 relative."""
    import fsdpp
    run = fsdpp.Run(run_file, {"policy.options.fused_linear_logprob": True})
    ids = torch.randint(101, (2, TOKENS + 1), generator=torch.Generator().manual_seed(4))
    targets = ids[:, 1:].clone()
    targets[0, :5] = fsdpp.IGNORE_INDEX
    targets[1, -3:] = fsdpp.IGNORE_INDEX
    kept = targets != fsdpp.IGNORE_INDEX
    logp = run.model.logprobs(ids[:, :-1], targets)
    logp.sum().backward()
    norm, _ = run.step(lr=0.0)  # the weights stay: the same state for the reference below
    run.zero_grad()
    want = full_logprobs(run.model(ids[:, :-1]), ids) * kept
    want.sum().backward()
    want_norm, _ = run.step(lr=0.0)
    gap = max(((logp.detach().double() - want.detach()).norm() / want.detach().norm()).item(),
              abs(norm - want_norm) / want_norm)
    ok = gap <= FIRST_STEP_BOUND and bool((logp[~kept] == 0).all())
    print(f"{'ok  ' if ok else 'FAIL'} ignored targets: logprobs 0 there, the rest and the gradient norm {gap:.1e} "
          f"from the full logits' (bound {FIRST_STEP_BOUND:.0e}, relative)")
    return ok


def corrupt_load_at_world_2(run_file, work, torchrun):
    """A world-2 checkpoint whose rank-1 file is corrupt, loaded at world 2: rank 1 alone reads
    that file, and both ranks raise fsdpp.Error, rank 1 naming the file and rank 0 saying
    another rank failed, rather than rank 0 waiting for rank 1 in a collective."""
    shutil.rmtree(os.path.join(work, "corrupt"), ignore_errors=True)
    out = os.path.join(work, "corrupt", "error")
    launch = [torchrun, "--standalone", "--nproc-per-node", "2", __file__]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(launch + ["--save-at-world-2", run_file, os.path.join(work, "corrupt")], check=True, timeout=300, env=env)
    checkpoint = os.path.join(work, "corrupt", "step-00000000")
    with open(os.path.join(checkpoint, "rank-00001.safetensors"), "r+b") as f:
        f.seek(-64, os.SEEK_END)
        f.write(bytes(64))
    subprocess.run(launch + ["--load", run_file, checkpoint, out], check=True, timeout=300, env=env)
    errors = [open(f"{out}.{r}").read() for r in range(2)]
    ok = (f"load: {checkpoint}/rank-00001.safetensors" in errors[1] and "checksum" in errors[1] and
          errors[0] == f"load: {checkpoint}: another rank failed (its error says why)")
    for r, message in enumerate(errors):
        print(f"{'ok  ' if ok else 'FAIL'} a corrupt rank-1 file loaded at world 2, rank {r}: {message}")
    return ok


def failed_loads(run_file, work):
    """A load that fails changes nothing where it can, and is never trained on where it cannot:
    a corrupt file is found before any row is copied (the run's weights as they were, and it
    steps on); a record forged behind a valid checksum fails mid-way, and the run then refuses
    to compute, step or save until a load completes."""
    import fsdpp
    from crc32c import crc32c
    root = os.path.join(work, "failed-loads")
    shutil.rmtree(root, ignore_errors=True)
    run = fsdpp.Run(run_file)
    rows = batches(101)
    run.model(rows[0][0]).sum().backward()
    run.step()
    saved = os.fsdecode(run.save(os.path.join(root, "good")))
    run.zero_grad()
    run.model(rows[1][0]).sum().backward()
    run.step()
    before = {name: t.clone() for name, t in run.full_weights(torch.float64)}
    corrupt = shutil.copytree(saved, os.path.join(root, "corrupt"))
    with open(os.path.join(corrupt, "rank-00000.safetensors"), "r+b") as f:
        f.seek(-64, os.SEEK_END)
        f.write(bytes(64))
    errors = []

    def refused(call, *args):
        try:
            call(*args)
        except fsdpp.Error as e:
            errors.append(str(e))
            return True
        return False

    ok = refused(run.load, corrupt) and "checksum" in errors[-1] and "partly" not in errors[-1]
    ok &= all(torch.equal(t, before[name]) for name, t in run.full_weights(torch.float64))
    ok &= refused(run.step) is False
    forged = shutil.copytree(saved, os.path.join(root, "forged"))
    meta_path = os.path.join(forged, "metadata.json")
    meta = json.load(open(meta_path))
    meta["tensors"]["model/model.norm.weight"]["dtype"] = "F32"  # stored as F64, read after other rows
    text = (json.dumps(meta, indent=1) + "\n").encode()
    open(meta_path, "wb").write(text)
    open(os.path.join(forged, "metadata.crc32c"), "w").write(f"crc32c:{crc32c(text):08x}\n")
    ok &= refused(run.load, forged) and errors[-1].endswith("(the run is now partly loaded)")
    ok &= refused(run.step) and refused(run.save, os.path.join(root, "mixed")) and refused(run.model, rows[0][0])
    ok &= refused(lambda: list(run.full_weights(torch.float64)))
    ok &= all(f"holds part of {forged} and part of its earlier state" in e for e in errors[-4:])
    run.load(saved)
    run.model(rows[1][0]).sum().backward()  # load() dropped the gradients of the weights it replaced
    ok &= refused(run.step) is False
    for e in errors:
        print(f"     {e}")
    print(f"{'ok  ' if ok else 'FAIL'} failed loads: a corrupt file changes no weight; a load failed mid-way is "
          "refused to compute, step and save on until a load completes")
    return ok


def graph_outlives_its_calls(run_file):
    """A forward's graph holds its run: a Run dropped before the backward of its logits or
    logprobs leaves a backward that runs. A logprobs backward after an offload and reload
    gives bitwise the step of one with nothing between; after a step between, it runs from
    the stepped weights, as run.model's does."""
    import gc
    import fsdpp
    ids = batches(101)[0][0]
    fused = {"policy.options.fused_linear_logprob": True}

    def dropped_run(forward):
        output = forward(fsdpp.Run(run_file, fused))
        gc.collect()
        output.sum().backward()
        return True

    ok = True
    for name, forward in [("logits", lambda run: run.model(ids)),
                          ("logprobs", lambda run: run.model.logprobs(ids[:, :-1], ids[:, 1:]))]:
        ran = dropped_run(forward)  # a use after free would end the interpreter here
        ok &= ran
        print(f"{'ok  ' if ran else 'FAIL'} the backward of {name} whose Run was dropped first runs")

    def logprobs_step(between):
        run = fsdpp.Run(run_file, fused)
        logp = run.model.logprobs(ids[:, :-1], ids[:, 1:])
        between(run)
        logp.sum().backward()
        return run.step(), {name: t.clone() for name, t in run.full_weights(dtype=torch.float64)}

    plain, plain_weights = logprobs_step(lambda run: None)
    for name, between in [("offload and reload", lambda run: (run.offload(), run.reload())),
                          ("offload of grads and optimizer, reload", lambda run: (run.offload(("grads", "optimizer")),
                                                                                   run.reload()))]:
        figures, weights = logprobs_step(between)
        same = figures == plain and all(torch.equal(weights[k], plain_weights[k]) for k in weights)
        ok &= same
        print(f"{'ok  ' if same else 'FAIL'} logprobs, {name}, then its backward and a step: "
              f"{'bitwise' if same else 'NOT'} as with nothing between")
    (norm, stepped), _ = logprobs_step(lambda run: (run.model(ids).sum().backward(), run.step(), run.zero_grad()))
    good = stepped and math.isfinite(norm) and norm > 0
    ok &= good
    print(f"{'ok  ' if good else 'FAIL'} logprobs, another forward's backward and a step, then its backward: "
          f"gradient norm {norm:.6f}")
    # Targets a sampling loop made under inference mode, which backward could not save.
    with torch.inference_mode():
        sampled = ids[:, 1:].clone()
    run = fsdpp.Run(run_file, fused)
    run.model.logprobs(ids[:, :-1], sampled).sum().backward()
    norm, stepped = run.step()
    good = stepped and math.isfinite(norm) and norm > 0
    ok &= good
    print(f"{'ok  ' if good else 'FAIL'} logprobs of targets made under inference mode: gradient norm {norm:.6f}")
    return ok


def backwards_of_every_shape(run_file):
    """A backward through several forwards (a DPO pair forwarded in two calls, a loss plus a
    term from a second forward) gives the gradient of the whole loss: the step equals the one
    two separate backwards give, to float64's rounding of the sums' order. A backward that ends in an exception (a
    hook of the loop's that raises) leaves a run whose next backward and step equal a fresh
    run's; create_graph through the units is refused in one line. A step called while another
    thread runs a backward waits for it, and equals the step after it."""
    import threading
    import fsdpp
    ids = batches(101)[0][0]
    flipped = ids.flip(1)

    def stepped(loop):
        run = fsdpp.Run(run_file, {"policy.options.fused_linear_logprob": True})
        loop(run)
        return run.step(), {name: t.clone() for name, t in run.full_weights(dtype=torch.float64)}

    def same(a, b):  # bitwise
        return a[0] == b[0] and all(torch.equal(a[1][k], b[1][k]) for k in a[1])

    def close(a, b):  # summed in another order
        return (a[0][1] == b[0][1] and abs(a[0][0] - b[0][0]) <= 1e-12 * b[0][0] and
                all(torch.allclose(a[1][k], b[1][k], rtol=0, atol=1e-12) for k in a[1]))

    ok = True
    separate = stepped(lambda run: (run.model(ids).sum().backward(), (0.5 * run.model(flipped).logsumexp(-1).sum()).backward()))
    joint = stepped(lambda run: (run.model(ids).sum() + 0.5 * run.model(flipped).logsumexp(-1).sum()).backward())
    joint_plain = joint
    good = close(joint, separate)
    ok &= good
    print(f"{'ok  ' if good else 'FAIL'} one backward of a loss over two forwards: norm {joint[0][0]:.12f}, "
          f"two backwards {separate[0][0]:.12f}")

    def pair(run, calls):
        chosen, rejected = ids[0::2], ids[1::2]
        if calls == 1:
            logp = run.model.logprobs(ids[:, :-1], ids[:, 1:])
            sums = logp.sum(-1)
            margin = sums[0::2] - sums[1::2]
        else:
            margin = (run.model.logprobs(chosen[:, :-1], chosen[:, 1:]).sum(-1) -
                      run.model.logprobs(rejected[:, :-1], rejected[:, 1:]).sum(-1))
        (-torch.nn.functional.logsigmoid(0.1 * margin).mean()).backward()

    one_call, two_calls = stepped(lambda run: pair(run, 1)), stepped(lambda run: pair(run, 2))
    good = close(two_calls, one_call)
    ok &= good
    print(f"{'ok  ' if good else 'FAIL'} a DPO pair's log-probs in two calls, one backward: norm {two_calls[0][0]:.12f}, "
          f"in one call {one_call[0][0]:.12f}")

    # Every order of forwards and backwards: a retained graph's second backward, a backward
    # of another forward between a forward and its own, and an uninvolved forward's output
    # detached first, each equal to the plain computation of the same gradient.
    def entropy(logits):
        return 0.5 * logits.logsumexp(-1).sum()

    def retained(run):
        loss = run.model(ids).sum() + entropy(run.model(flipped))
        loss.backward(retain_graph=True)
        loss.backward()

    def backward_between(run):
        early = run.model(ids)
        run.model(flipped).sum().backward()
        run.zero_grad()
        (early.sum() + entropy(run.model(flipped))).backward()

    def detached_first(run):
        run.model(flipped).detach()  # old log-probs taken without no_grad
        (run.model(ids).sum() + entropy(run.model(flipped))).backward()

    for name, loop, want in [("a retained graph backwarded twice", retained,
                              lambda run: (2 * (run.model(ids).sum() + entropy(run.model(flipped)))).backward()),
                             ("a backward of another forward between", backward_between, None),
                             ("a detached forward before", detached_first, None)]:
        got = stepped(loop)
        expected = stepped(want) if want else joint_plain
        good = close(got, expected)
        ok &= good
        print(f"{'ok  ' if good else 'FAIL'} {name}: norm {got[0][0]:.12f}, the plain computation's {expected[0][0]:.12f}")

    fresh = stepped(lambda run: run.model(ids).sum().backward())

    def raising(run):
        logits = run.model(ids)

        def hook(grad):
            raise ValueError("the loop's hook")
        logits.register_hook(hook)
        try:  # the root unit's own hook on its output, the logits, has begun the backward
            logits.sum().backward()
        except ValueError as e:
            assert "the loop's hook" in str(e), e
        run.zero_grad()
        run.model(ids).sum().backward()

    def create_graph(run):
        try:
            run.model(ids).sum().backward(create_graph=True)
        except RuntimeError as e:
            assert str(e).startswith("backward with create_graph=True through the sharded units is not supported"), e
        run.zero_grad()
        run.model(ids).sum().backward()

    def raising_then_another(run):
        logits, other = run.model(flipped), run.model(ids)
        logits.register_hook(lambda grad: (_ for _ in ()).throw(ValueError("the loop's hook")))
        try:
            logits.sum().backward()
        except ValueError:
            pass
        other.sum().backward()  # straight after, with no call into the run between

    for name, loop in [("a hook that raises", raising), ("create_graph=True", create_graph),
                       ("a hook that raises (another forward's backward straight after)", raising_then_another)]:
        after = stepped(loop)
        good = same(after, fresh)
        ok &= good
        print(f"{'ok  ' if good else 'FAIL'} a backward ended by {name}, then a backward and a step: norm "
              f"{after[0][0]:.12f}, a fresh run's {fresh[0][0]:.12f}")

    def from_a_thread(run):
        logits = run.model(torch.cat([ids] * 8))
        begun = threading.Event()
        # After the root unit's own hook, which begins the units' backward.
        logits.register_hook(lambda grad: begun.set())
        thread = threading.Thread(target=lambda: logits.sum().backward())
        thread.start()
        begun.wait()
        figures = run.step()
        thread.join()
        return figures

    run = fsdpp.Run(run_file)
    during = from_a_thread(run)
    run = fsdpp.Run(run_file)
    run.model(torch.cat([ids] * 8)).sum().backward()
    after = run.step()
    good = during == after
    ok &= good
    print(f"{'ok  ' if good else 'FAIL'} a step while another thread runs the backward waits for it: {during}, "
          f"after it {after}")
    return ok


def threads_share_a_run(run_file):
    """Four threads calling run.model on one Run get what one thread gets: each call waits
    for the one driving the run."""
    import threading
    import fsdpp
    run = fsdpp.Run(run_file)
    ids = batches(101)[0][0]
    with torch.no_grad():
        want = run.model(ids)
    gaps, errors = [], []

    def forwards():
        try:
            for _ in range(10):
                with torch.no_grad():
                    gaps.append((run.model(ids) - want).abs().max().item())
        except Exception as e:  # reported below: the check fails on any
            errors.append(repr(e))

    threads = [threading.Thread(target=forwards) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ok = not errors and len(gaps) == 40 and max(gaps) == 0
    print(f"{'ok  ' if ok else 'FAIL'} 4 threads x 10 forwards on one Run: {len(gaps)} outputs, largest difference "
          f"{max(gaps) if gaps else None}, errors {errors[:1]}")
    return ok


def overlapping_callers(run_file):
    """What an RL loop's threads and habits do to one Run: a rollout thread's forwards while
    the learner's backwards run leave the learner's step what it is alone; a backward begun
    while another thread's runs is refused in one line and the first goes on; a forward under
    torch.autocast computes in the plan's precision, its backward outside autocast, and a
    backward under autocast recomputes as the forward computed."""
    import threading
    import fsdpp
    ids = batches(101)[0][0]

    def learner(run, backwards=3):
        for _ in range(backwards):
            run.model(ids).sum().backward()
        return run.step()

    alone = learner(fsdpp.Run(run_file))
    run = fsdpp.Run(run_file)
    stop = threading.Event()

    def sampler():
        with torch.no_grad():
            while not stop.is_set():
                run.model(ids)

    thread = threading.Thread(target=sampler)
    thread.start()
    try:
        beside = learner(run)
    finally:
        stop.set()
        thread.join()
    ok = beside == alone
    print(f"{'ok  ' if ok else 'FAIL'} backwards beside a sampling thread's forwards: {beside}, alone {alone}")

    run = fsdpp.Run(run_file)
    first, second = run.model(ids), run.model(ids.flip(1))
    begun, release = threading.Event(), threading.Event()

    def held(grad):  # after the root unit's own hook, which begins the units' backward
        begun.set()
        release.wait()

    first.register_hook(held)
    thread = threading.Thread(target=lambda: first.sum().backward())
    thread.start()
    begun.wait()
    try:
        second.sum().backward()
        refused = "no error"
    except RuntimeError as e:  # raised inside autograd's engine, which makes any error a RuntimeError
        refused = str(e)
    finally:
        release.set()
        thread.join()
    after = run.step()
    good = "backwards through one run go one at a time" in refused and after == learner(fsdpp.Run(run_file), 1)
    ok &= good
    print(f"{'ok  ' if good else 'FAIL'} a backward begun while another thread's runs: {refused}; the first's step {after}")

    def under_autocast(run):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = run.model(ids)
        logits.sum().backward()
        return logits.dtype, run.step()

    in_float32 = {"model.dtype": "float32"}
    under, plain = under_autocast(fsdpp.Run(run_file, in_float32)), learner(fsdpp.Run(run_file, in_float32), 1)
    good = under == (torch.float32, plain)
    ok &= good
    print(f"{'ok  ' if good else 'FAIL'} a float32 run's forward under autocast(bfloat16): {under}, without {plain}")

    # A backward under autocast (which torch's own backward ops follow) recomputes each
    # checkpointed layer's forward as it ran, so it gives what the saved activations give.
    def backward_under_autocast(checkpointed):
        run = fsdpp.Run(run_file, {**in_float32, "policy.options.fused_linear_logprob": True,
                                   "policy.options.activation_checkpoint": checkpointed})
        logp = run.model.logprobs(ids[:, :-1], ids[:, 1:])
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logp.sum().backward()
        return run.step()

    recomputed, saved = backward_under_autocast(True), backward_under_autocast(False)
    good = recomputed == saved
    ok &= good
    print(f"{'ok  ' if good else 'FAIL'} a backward under autocast(bfloat16), layers recomputed: {recomputed}, "
          f"activations saved {saved}")
    return ok


def save_refused_at_world_2(run_file, work, torchrun):
    """A save under a path that is a file, at world 2: rank 0 cannot make the directory, and
    both ranks raise fsdpp.Error at once, rank 1 saying another rank failed, rather than rank 1
    waiting on a collective for rank 0."""
    shutil.rmtree(os.path.join(work, "unsaved"), ignore_errors=True)
    os.makedirs(os.path.join(work, "unsaved"))
    blocker = os.path.join(work, "unsaved", "a-file")
    open(blocker, "w").close()
    out = os.path.join(work, "unsaved", "error")
    subprocess.run([torchrun, "--standalone", "--nproc-per-node", "2", __file__, "--save-under", run_file,
                    os.path.join(blocker, "checkpoints"), out], check=True, timeout=120,
                   env={**os.environ, "OMP_NUM_THREADS": "1"})
    errors = [open(f"{out}.{r}").read() for r in range(2)]
    where = os.path.join(blocker, "checkpoints")
    ok = (errors[0].startswith(f"save: {where}: ") and "Not a directory" in errors[0] and "\n" not in errors[0] and
          errors[1] == f"save: {where}: another rank failed (its error says why)")
    for r, message in enumerate(errors):
        print(f"{'ok  ' if ok else 'FAIL'} a save under a file at world 2, rank {r}: {message}")
    return ok


def path_of_any_bytes(run_file, work):
    """A checkpoint saved under a name of no UTF-8 (as os.listdir gives one it cannot decode)
    returns its path as os.fsdecode gives it, and the log writes the byte out."""
    root = os.fsencode(os.path.join(work, "any-bytes")) + b"/ck\xff"
    shutil.rmtree(os.path.dirname(root), ignore_errors=True)
    script = ("import fsdpp, os, sys\n"
              f"print(fsdpp.Run({run_file!r}).save({root!r}) == os.fsdecode({root!r} + b'/step-00000000'))\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=120)
    ok = proc.stdout.strip() == b"True" and b"ck\\xff/step-00000000" in proc.stderr and b"\xff" not in proc.stderr
    print(f"{'ok  ' if ok else 'FAIL'} a checkpoint under a name of no UTF-8: returned as os.fsdecode gives it: "
          f"{proc.stdout.strip().decode()}, logged {[l for l in proc.stderr.decode(errors='replace').splitlines() if 'saved' in l]}")
    return ok


def runs_one_after_another(run_file, work, torchrun):
    """At world 2, a process makes a Run, trains a step, drops it and makes the next, three
    times: each Run rendezvouses with the other rank's Run of the same turn (a rank ahead
    reached the other's previous store), so every turn's step is the first turn's."""
    out = os.path.join(work, "one-after-another")
    subprocess.run([torchrun, "--standalone", "--nproc-per-node", "2", __file__, "--one-after-another", run_file, out],
                   check=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    turns = [json.load(open(f"{out}.{r}")) for r in range(2)]
    ok = turns[0] == turns[1] and len(turns[0]) == 3 and all(t == turns[0][0] for t in turns[0])
    print(f"{'ok  ' if ok else 'FAIL'} three Runs one after another at world 2: steps {turns[0]} and {turns[1]}")
    return ok


def bad_uses(run_file, other_model_dir, work):
    """Each bad use of the run of `run_file` (the tied model's) raises fsdpp.Error with its
    one-line message; the interpreter goes on."""
    import fsdpp
    run = fsdpp.Run(run_file)
    ids = torch.zeros(2, 5, dtype=torch.long)
    shutil.rmtree(os.path.join(work, "other"), ignore_errors=True)  # a rerun's
    os.makedirs(os.path.join(work, "other"))
    other = fsdpp.Run(write_run_file(os.path.join(work, "other"), other_model_dir)).save(os.path.join(work, "other"))
    later = os.path.join(work, "later")  # the run's own step 1, which a save of its step 0 would sit behind
    shutil.rmtree(later, ignore_errors=True)
    ahead = fsdpp.Run(run_file)
    ahead.model(ids).sum().backward()
    ahead.step()
    ahead.save(later)
    del ahead

    def in_a_hook(call):
        logits = run.model(ids)
        logits.register_hook(lambda grad: call())
        logits.sum().backward()
    one_step = fsdpp.Run(run_file, {"scheduler.kind": "cosine", "train.steps": 1})

    def step_of(decaying):
        decaying.model(ids).sum().backward()
        decaying.step()

    def stopped_at_logits(call):
        logits = run.model(ids)
        logits.sum().backward(inputs=[logits])
        call()
    def loaded_after_backward(call):
        saved = run.save(fresh_dir(os.path.join(work, "before-backward")))
        run.model(ids).sum().backward()
        run.load(saved)  # drops the gradients of the weights it replaced
        call()
    cases = [
        ("float input_ids", lambda: run.model(ids.float()),
         "input_ids: expected a [batch, tokens] int64 tensor, got Float [2, 5]"),
        ("1-D input_ids", lambda: run.model(ids[0]), "input_ids: expected a [batch, tokens] int64 tensor, got Long [5]"),
        ("a token outside the vocabulary", lambda: run.model(ids + 10_000), "input_ids: token ids must be in [0, "),
        ("position_ids shaped apart from input_ids", lambda: run.model(ids, position_ids=ids[:, :3]),
         "position_ids: expected an int64 tensor shaped as input_ids [2, 5], got Long [2, 3]"),
        ("a negative position", lambda: run.model(ids, position_ids=ids - 1), "position_ids: positions must be >= 0, got -1"),
        ("document offsets that do not cover the rows",
         lambda: run.model(ids, document_offsets=torch.tensor([0, 4])), "document_offsets: must rise from 0 to the 10"),
        ("a misspelt run-file key", lambda: fsdpp.Run(run_file, {"train.stpes": 3}),
         "overrides: train.stpes=3: [train] stpes: unknown key; did you mean 'steps'?"),
        ("numpy's integer as an override, written as TOML's", lambda: fsdpp.Run(run_file, {"train.stpes": np.int64(3)}),
         "overrides: train.stpes=3: [train] stpes: unknown key; did you mean 'steps'?"),
        ("numpy's float as an override, written as TOML's",
         lambda: fsdpp.Run(run_file, {"train.clip_grad_norm": np.float32(-0.5)}),
         "overrides: train.clip_grad_norm=-0.5: [train] clip_grad_norm"),
        ("an override of no TOML type", lambda: fsdpp.Run(run_file, {"train.steps": [3]}),
         "overrides: train.steps: expected a bool, int, float, str or path, got list"),
        ("a policy option the policy lacks", lambda: fsdpp.Run(run_file, {"policy.options.lora_rnak": 8}),
         "[policy.options] lora_rnak: the policy policies/llama.lua has no such option; did you mean 'lora_rank'?"),
        ("offloading what a run has not", lambda: run.offload("weights"),
         "offload: 'weights' is not one of params, grads, optimizer"),
        ("offloading nothing", lambda: run.offload(()), "offload: name at least one of params, grads, optimizer"),
        ("an unknown grad_reduction", lambda: fsdpp.Run(run_file, grad_reduction="avg"),
         "grad_reduction: 'avg' is not one of mean, sum"),
        ("logprobs with lm_head in a unit of its own", lambda: run.model.logprobs(ids, ids),
         "logprobs: the output head must stay in the root unit, gathered until backward: set "
         "[policy.options] fused_linear_logprob = true"),
        ("logprobs of targets shaped apart", lambda: run.model.logprobs(ids, ids[:, :3]),
         "targets: expected the shape of input_ids [2, 5], got [2, 3]"),
        ("logprobs at temperature 0", lambda: run.model.logprobs(ids, ids, temperature=0),
         "temperature: must be a positive number in [1e-06, 1e+06], got 0"),
        ("logprobs at a temperature that overflows the logits", lambda: run.model.logprobs(ids, ids, temperature=1e-300),
         "temperature: must be a positive number in [1e-06, 1e+06], got 1e-300"),
        ("loading a directory that holds no checkpoint", lambda: run.load(work),
         f"load: {work} is not a complete checkpoint (no metadata.json with its metadata.crc32c)"),
        ("loading an untied model's checkpoint into a tied one", lambda: run.load(other),
         "llama_tied_rope3 (rope_theta 10000.0 -> 500000.0, tie_word_embeddings false -> true, rope_scaling from "
         "the checkpoint's config.json to this run's)"),
        ("input_ids as a list", lambda: run.model([[1, 2, 3]]), "input_ids: expected a torch.Tensor, got list"),
        ("input_ids on the meta device", lambda: run.model(torch.zeros(2, 5, dtype=torch.long, device="meta")),
         "input_ids: a meta tensor, which holds no values"),
        ("a temperature of no number", lambda: run.model.logprobs(ids, ids, temperature="hot"),
         "temperature: must be a positive number, got str"),
        ("offloading a name of no string", lambda: run.offload([1]), "offload: 1 is not one of params, grads, optimizer"),
        ("a grad_reduction of no string", lambda: fsdpp.Run(run_file, grad_reduction=None),
         'grad_reduction: expected "mean" or "sum", got NoneType'),
        ("overrides as a list", lambda: fsdpp.Run(run_file, [("train.steps", 3)]),
         "overrides: expected a mapping of dotted keys to values, got list"),
        ("an override key that holds a value", lambda: fsdpp.Run(run_file, {"optimizer.lr=0.5 #": 1}),
         "overrides: 'optimizer.lr=0.5 #' is not a dotted key such as 'train.out_dir'"),
        ("an override past 64-bit integers", lambda: fsdpp.Run(run_file, {"train.steps": 2**63}),
         "overrides: train.steps: 9223372036854775808 is outside TOML's 64-bit integers"),
        ("saving to an empty path", lambda: run.save(""), "save: the directory is an empty path"),
        ("saving a step saved already", lambda: run.save(os.path.dirname(other)),
         f"save: {other} exists already; save to another directory or remove it"),
        ("offloading None", lambda: run.offload(None), "offload: expected names among params, grads, optimizer, got NoneType"),
        ("loading None", lambda: run.load(None), "load: expected a str, bytes or path, got NoneType"),
        ("saving to a number", lambda: run.save(3), "save: expected a str, bytes or path, got int"),
        ("a temperature past a float's range", lambda: run.model.logprobs(ids, ids, temperature=10**400),
         "temperature: must be a positive number within a float's range, got an integer of 401 digits"),
        ("a temperature that requires grad", lambda: run.model.logprobs(ids, ids, temperature=torch.tensor(0.8, requires_grad=True)),
         "temperature: a tensor that requires grad, whose gradient this call does not give; pass a number, or "
         "temperature.detach()"),
        ("a negative temperature past a float's range", lambda: run.model.logprobs(ids, ids, temperature=-10**400),
         "temperature: must be a positive number within a float's range, got an integer of 401 digits"),
        ("rows of no token with a mask", lambda: run.model(ids[:, :0], attention_mask=torch.ones(ids.shape[0], 0, dtype=torch.long)),
         "input_ids: empty"),
        ("sparse input_ids", lambda: run.model(ids.to_sparse()), "input_ids: expected a dense tensor, got a torch.sparse_coo one"),
        ("full weights as integers", lambda: next(run.full_weights(torch.int64)),
         "full_weights: dtype must be a floating torch.dtype, got torch.int64"),
        ("a step with no backward", lambda: run.step(), "step: no gradients since zero_grad"),
        ("a step after a backward that stopped at the logits", lambda: stopped_at_logits(run.step),
         "step: no gradients since zero_grad"),
        ("a step after a load() that followed a backward", lambda: loaded_after_backward(run.step),
         "step: no gradients since zero_grad"),
        ("a step past the end of a decaying schedule", lambda: [step_of(one_step) for _ in range(2)],
         "step: the run has taken its [train] steps = 1, where its [scheduler] decays to a learning rate of 0"),
        ("saving behind a later checkpoint of the run", lambda: run.save(later),
         f"save: {later}/step-00000001 is a later checkpoint of this run than step 0"),
        ("a document spanning rows", lambda: run.model(ids, document_offsets=torch.tensor([0, 3, 7, 10])),
         "document_offsets: a document spans rows 0 and 1: no offset is 5, where row 1 of 5 tokens starts"),
        ("a path holding a NUL byte", lambda: run.load(os.path.join(work, "a\0b")), "load: the path holds a NUL byte"),
        ("a path the system refuses", lambda: run.save(os.path.join(work, "x" * 300)), "File name too long"),
        ("a step from a backward's hook", lambda: in_a_hook(run.step),
         "step: not from inside a backward through the units (a hook's call)"),
        ("an offload from a backward's hook", lambda: in_a_hook(lambda: run.offload("grads")),
         "offload: not from inside a backward through the units (a hook's call)"),
        ("a load from a backward's hook", lambda: in_a_hook(lambda: run.load(later)),
         "load: not from inside a backward through the units (a hook's call)"),
    ]
    ok = True
    for name, call, expected in cases:
        try:
            call()
            message = "no error"
        except fsdpp.Error as e:
            message = str(e)
        good = expected in message and "\n" not in message
        ok = ok and good
        print(f"{'ok  ' if good else 'FAIL'} {name}: {message}")
    # A decay to a min_lr_ratio above 0 goes on past [train] steps at its last rate.
    floor = fsdpp.Run(run_file, {"scheduler.kind": "cosine", "train.steps": 1, "scheduler.min_lr_ratio": 0.1})
    for _ in range(2):
        step_of(floor)
    good = floor.steps == 2
    ok = ok and good
    print(f"{'ok  ' if good else 'FAIL'} a decay to min_lr_ratio 0.1 steps past [train] steps: {floor.steps} steps")
    # A temperature may be any real scalar a loop holds: numpy's, or a one-element tensor.
    import numpy
    head_in_root = fsdpp.Run(run_file, {"policy.options.fused_linear_logprob": True})
    with torch.no_grad():
        want = head_in_root.model.logprobs(ids, ids, temperature=0.5)
        scalars = [head_in_root.model.logprobs(ids, ids, temperature=t) for t in (numpy.float32(0.5), torch.tensor(0.5))]
    good = all(torch.equal(got, want) for got in scalars)
    ok = ok and good
    print(f"{'ok  ' if good else 'FAIL'} a temperature given as numpy.float32 or a one-element tensor")
    # The run still trains after all of that.
    logits = run.model(ids)
    logits.sum().backward()
    norm, stepped = run.step()
    ok = ok and stepped and norm > 0
    return ok


def a_loops_own_rate(run_file):
    """step(lr=scheduled_lr) is step() bitwise; step(lr=0) leaves every weight as it was."""
    import fsdpp
    ids = batches(101)[0][0]
    weights = []
    for lr in (None, "scheduled", 0.0):
        run = fsdpp.Run(run_file)
        before = {name: t.clone() for name, t in run.full_weights(dtype=torch.float64)}
        run.model(ids[:, :-1]).logsumexp(-1).mean().backward()
        run.step(lr=run.scheduled_lr if lr == "scheduled" else lr)
        weights.append({name: t.clone() for name, t in run.full_weights(dtype=torch.float64)})
    same = all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    still = all(torch.equal(weights[2][k], before[k]) for k in before)
    ok = same and still and not torch.equal(weights[0]["model.norm.weight"], before["model.norm.weight"])
    print(f"{'ok  ' if ok else 'FAIL'} step(lr=run.scheduled_lr) {'equals' if same else 'DIFFERS FROM'} step() "
          f"bitwise; step(lr=0) {'leaves' if still else 'DOES NOT LEAVE'} every weight as it was")
    return ok


def full_weights_across_a_step(run_file):
    """An iteration of full_weights that a step interrupts raises rather than hand out the rest
    of the units from after the step; a skipped look (offload, reload) leaves it going."""
    import fsdpp
    run = fsdpp.Run(run_file)
    ids = batches(101)[0][0]
    weights = run.full_weights(dtype=torch.float64)
    next(weights)
    run.offload()
    run.reload()
    next(weights)  # the weights are as they were
    run.model(ids).logsumexp(-1).mean().backward()
    run.step()
    try:
        list(weights)
        error = "no error"
    except fsdpp.Error as e:
        error = str(e)
    ok = error.startswith("full_weights: the run stepped or loaded while this iteration was under way")
    print(f"{'ok  ' if ok else 'FAIL'} full_weights interrupted by a step: {error}")
    return ok


def generators_left_alone(run_file):
    """Building a Run leaves torch's generator as the loop seeded it (the run seeds its own per
    rank): the loop's sampling draws what it would have drawn without the Run."""
    import fsdpp
    torch.manual_seed(42)
    want = torch.rand(4)
    torch.manual_seed(42)
    fsdpp.Run(run_file)
    got = torch.rand(4)
    ok = torch.equal(got, want)
    print(f"{'ok  ' if ok else 'FAIL'} Run() leaves torch's generator as the loop seeded it: {got.tolist()} "
          f"against {want.tolist()}")
    return ok


def main():
    if sys.argv[1] == "--save-at-world-2":  # torchrun's processes: a world-2 checkpoint of step 0
        import fsdpp
        fsdpp.Run(sys.argv[2]).save(sys.argv[3])
        return 0
    if sys.argv[1] in ("--load", "--save-under"):  # torchrun's processes: each rank's error loading or saving
        import fsdpp
        run = fsdpp.Run(sys.argv[2])
        try:
            (run.load if sys.argv[1] == "--load" else run.save)(sys.argv[3])
            message = "no error"
        except fsdpp.Error as e:
            message = str(e)
        open(f"{sys.argv[4]}.{run.rank}", "w").write(message)
        return 0
    if sys.argv[1] == "--one-after-another":  # torchrun's processes: a Run per turn, each dropped
        import gc
        import fsdpp
        steps = []
        for _ in range(3):
            run = fsdpp.Run(sys.argv[2], {"parallel.timeout_s": 60})
            run.model(batches(101)[0][0]).sum().backward()
            steps.append(list(run.step()))
            run = None
            gc.collect()
        json.dump(steps, open(f"{sys.argv[3]}.{int(os.environ['RANK'])}", "w"))
        return 0
    if sys.argv[1] == "--rank":  # one of torchrun's processes
        run_file, loss_name, out = sys.argv[2:5]
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        load = sys.argv[5] if len(sys.argv) > 5 else None
        steps = range(3, STEPS) if load else range(STEPS)
        (losses, norms), weights, _ = train_fsdpp(run_file, loss_name, rank, world, steps, load=load)
        with open(f"{out}.{rank}", "w") as f:
            json.dump({"losses": losses, "norms": norms}, f)
        torch.save(weights, f"{out}.{rank}.pt")
        return 0
    fixtures, work = sys.argv[1], sys.argv[2]
    ok = True
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    for model, loss_name in [("llama_untied", "clipped-ratio"), ("llama_untied", "dpo-margin"),
                             ("llama_tied_rope3", "dpo-margin"), ("llama_tied_rope3", "ratio-entropy")]:
        case = f"{model}-{loss_name}"
        os.makedirs(os.path.join(work, case), exist_ok=True)
        model_dir = os.path.join(fixtures, model)
        run_file = write_run_file(os.path.join(work, case), model_dir)
        vocab = json.load(open(os.path.join(model_dir, "config.json")))["vocab_size"]
        want, want_weights = train_reference(model_dir, vocab, loss_name)
        # World 1: this very process, as a plain script would run it. Its rows are the whole
        # batch, whose mean loss equals the mean of the two halves' (equal sizes).
        one = train_fsdpp(run_file, loss_name, 0, 1)[:2]
        ok &= compare_transformers(f"{case}, world 1 in this process", one[0], want)
        ok &= compare_names(f"{case}", one[1], want_weights)
        out = os.path.join(work, case, "world2.json")
        subprocess.run([torchrun, "--standalone", "--nproc-per-node", "2", __file__, "--rank", run_file, loss_name, out],
                       check=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
        ranks = [json.load(open(f"{out}.{r}")) for r in range(2)]
        # Each rank's loss is its half's mean; the step's loss is their average.
        losses = [(a + b) / 2 for a, b in zip(ranks[0]["losses"], ranks[1]["losses"])]
        ok &= ranks[0]["norms"] == ranks[1]["norms"]
        two = (losses, ranks[0]["norms"])
        ok &= compare_transformers(f"{case}, world 2 under torchrun", two, want)
        for r in range(2):
            ok &= compare_worlds(f"{case}, world 2 rank {r}", (two, torch.load(f"{out}.{r}.pt")), one)
        if model == "llama_untied":
            ok &= save_resume_export(run_file, loss_name, os.path.join(work, case), one, torchrun)
        if case == "llama_untied-clipped-ratio":
            ok &= overlapped_host_update(run_file, loss_name, os.path.join(work, case))
    ok &= chosen_positions(run_file, os.path.join(fixtures, "llama_tied_rope3"))
    ok &= ignored_targets(run_file)
    ok &= corrupt_load_at_world_2(run_file, work, torchrun)
    ok &= failed_loads(run_file, work)
    ok &= offload_round_trip(run_file)
    ok &= generators_left_alone(run_file)
    ok &= full_weights_across_a_step(run_file)
    ok &= a_loops_own_rate(run_file)
    ok &= graph_outlives_its_calls(run_file)
    ok &= threads_share_a_run(run_file)
    ok &= overlapping_callers(run_file)
    ok &= backwards_of_every_shape(run_file)
    ok &= save_refused_at_world_2(run_file, work, torchrun)
    ok &= runs_one_after_another(run_file, work, torchrun)
    ok &= path_of_any_bytes(run_file, work)
    ok &= bad_uses(run_file, os.path.join(fixtures, "llama_untied"), os.path.join(work, "bad-uses"))
    ok &= tied_head_adapter(os.path.join(fixtures, "llama_tied_rope3"), os.path.join(work, "tied-head"))
    ok &= dropout_follows_train_and_eval(os.path.join(fixtures, "llama_untied"), os.path.join(work, "dropout"))
    ok &= resume_of_a_binary_run(os.path.join(work, "binary-run"))
    return 0 if ok else 1


def resume_of_a_binary_run(out_dir):
    """A run fsdpp train saved goes on in Python from its own out_dir: the loop brings its own
    rows, so the run's data file is no other run's."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    subprocess.run(["bash", "scripts/make_corpus.sh"], cwd=root, check=True, stdout=subprocess.DEVNULL, timeout=300)
    shutil.rmtree(out_dir, ignore_errors=True)
    run_file = os.path.join(root, "tests/assets/fsdp-llama.toml")
    subprocess.run([os.environ["FSDPP"], "train", run_file, "--set", f'train.out_dir="{out_dir}"', "--set",
                    "train.steps=2", "--set", "checkpoint.save_every=2"], cwd=root, check=True, timeout=300,
                   stderr=subprocess.DEVNULL)
    # The loop's own run file holds no [data]: the data keys the binary's run read are no
    # other settings to warn of, where a changed learning rate is.
    text = open(run_file).read()
    loop_file = os.path.join(os.path.dirname(out_dir), "loop.toml")
    with open(loop_file, "w") as f:
        f.write(text[:text.index("[data]")] + text[text.index("[optimizer]"):])

    def resumed(overrides):
        code = ("import sys, fsdpp; print(fsdpp.Run(sys.argv[1], {'train.out_dir': sys.argv[2], "
                "'checkpoint.resume': 'latest', **eval(sys.argv[3])}).steps)")
        proc = subprocess.run([sys.executable, "-c", code, loop_file, out_dir, repr(overrides)], cwd=root,
                              capture_output=True, text=True, timeout=300)
        warned = [line for line in proc.stderr.splitlines() if "resuming with other settings" in line]
        return (int(proc.stdout) if proc.returncode == 0 else None), warned, proc.stderr.strip()[-300:]

    steps, warned, said = resumed({})
    print(f"{'ok  ' if steps == 2 and not warned else 'FAIL'} a Python run without [data] in the out_dir of a run "
          f"fsdpp train saved: {f'resumed at step {steps}' if steps else said}; {warned or 'no other settings'}")
    lr_steps, lr_warned, said = resumed({"optimizer.lr": 2e-2})
    lr_named = lr_steps == 2 and len(lr_warned) == 1 and "optimizer.lr 0.01 -> 0.02" in lr_warned[0] and \
        "data." not in lr_warned[0]
    print(f"{'ok  ' if lr_named else 'FAIL'} with another learning rate it warns of that alone: {lr_warned or said}")
    # The Python run kept the record's data: a run of another data file is still refused.
    other = os.path.join(os.path.dirname(out_dir), "other.tok")
    shutil.copy(os.path.join(root, "data/licenses.tok"), other)
    proc = subprocess.run([os.environ["FSDPP"], "train", run_file, "--set", f'train.out_dir="{out_dir}"', "--set",
                           f'data.train="{other}"', "--set", 'checkpoint.resume="latest"'], cwd=root,
                          capture_output=True, text=True, timeout=300)
    refused = proc.returncode == 2 and "holds another run" in proc.stderr
    print(f"{'ok  ' if refused else 'FAIL'} then a run of other data is refused: {proc.stderr.strip()[-200:]}")
    return steps == 2 and not warned and lr_named and refused


def tied_head_adapter(model_dir, work):
    """A tied model with an adapter on lm_head, trained a step: full_weights gives the head as a
    weight of its own, adapter merged, and equals fsdpp export --merge-lora bitwise, which
    unties the two."""
    import fsdpp
    from safetensors.torch import load_file
    fresh_dir(work)
    run = fsdpp.Run(write_run_file(work, model_dir), {"policy.options.lora_rank": 2,
                                                      "policy.options.lora_targets": "q_proj,lm_head"})
    vocab = json.load(open(os.path.join(model_dir, "config.json")))["vocab_size"]
    ids = batches(vocab)[0][0]
    logits = run.model(ids[:, :-1])
    torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), ids[:, 1:].reshape(-1)).backward()
    run.step()
    weights = {name: t.clone() for name, t in run.full_weights(dtype=torch.float64)}
    saved = run.save(os.path.join(work, "saved"))
    exported = os.path.join(work, "exported")
    subprocess.run([os.environ["FSDPP"], "export", saved, exported, "--dtype", "float64", "--merge-lora"], check=True,
                   timeout=120, stderr=subprocess.DEVNULL)
    export = load_file(os.path.join(exported, "model.safetensors"))
    head = "lm_head.weight" in weights and not torch.equal(weights["lm_head.weight"], weights["model.embed_tokens.weight"])
    same = set(export) == set(weights) and all(torch.equal(export[k], weights[k]) for k in weights)
    print(f"{'ok  ' if head and same else 'FAIL'} a tied model's adapted lm_head: full_weights gives it apart from the "
          f"embedding ({head}) and {'equals' if same else 'DIFFERS from'} the merged export, {len(export)} tensors")
    return head and same


def dropout_follows_train_and_eval(model_dir, work):
    """LoRA's dropout acts in run.model.train() (as after Run(): two forwards of the same rows
    differ) and not in eval() (they agree), as a torch module's does."""
    import fsdpp
    fresh_dir(work)
    run = fsdpp.Run(write_run_file(work, model_dir), {"policy.options.lora_rank": 2,
                                                      "policy.options.lora_dropout": 0.5})
    ids = batches(101)[0][0][:, :-1]
    run.model(ids).sum().backward()
    run.step()  # lora_B starts at zero, where dropout on the adapters' input changes nothing
    with torch.no_grad():
        trained = [run.model(ids) for _ in range(2)]
        was_training = run.model.training
        run.model.eval()
        evaluated = [run.model(ids) for _ in range(2)]
    run.model.train()
    ok = (was_training and not torch.equal(*trained) and torch.equal(*evaluated) and run.model.training and
          run.model.eval() is run.model and not run.model.training)
    print(f"{'ok  ' if ok else 'FAIL'} LoRA dropout on in train() (forwards differ: {not torch.equal(*trained)}), "
          f"off in eval() (forwards agree: {torch.equal(*evaluated)})")
    return ok


if __name__ == "__main__":
    sys.exit(main())
