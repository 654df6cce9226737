"""PPO critics and reward models through fsdpp.Run, against transformers + torch.optim.AdamW in
one process: a value head of the loop's own on run.model.hidden_states, and a
LlamaForSequenceClassification checkpoint (num_labels 1) whose score head the run builds.

Each critic trains with PPO's clipped value loss for 5 steps in float64; the value head
(torch.nn.Linear(C, 1), trained by the loop's own AdamW) reads the final hidden states of a
transformers-saved Llama, untied (lm_head its own unit, never run) and tied:
- the hidden states equal transformers' last_hidden_state (1e-6 relative: transformers
  computes its rotary tables in float32), packed documents each their own;
- losses and gradient norms against transformers as check_python_run.py bounds them; world 2
  (torchrun; the value head's gradient averaged over the ranks by torch.distributed, beside
  the run's own groups) against world 1 within 1e-10, the head's weights and the model's;
- the untied lm_head, which such a loss never reaches, as it was: the step leaves a parameter
  no rank's backward reached alone, as torch's AdamW does (no weight decay, no moments);
- the sequence-classification model: its scores [B, T, 1] train as the value head's do; its
  checkpoint, exported by `fsdpp export`, loads in transformers' AutoModelForSequenceClassification
  and scores a row as the run does; frozen, it scores as transformers does (a reward model);
  logprobs and `fsdpp train` refuse it on one line;
- a frozen run's hidden states equal the trained run's before it steps; hidden_states while
  the params are offloaded raises fsdpp.Error;
- a language model's weights under a classifier's config build with the score head drawn
  afresh, as transformers draws it; under LoRA the score head trains beside the adapters;
- an actor, the classifier as its critic and a frozen reference, three Runs in one process at
  world 2, step together with the same figures on both ranks.

usage: check_critic.py FIXTURE_DIR WORK_DIR
"""
import os
import sys

import torch

from check_python_run import (FIRST_STEP_BOUND, FLOAT64_BOUND, ROWS, STEPS, batches, compare_transformers, fresh_dir,
                              run_ranks, write_run_file)

LR, WEIGHT_DECAY, CLIP_VALUE = 1e-2, 0.1, 0.2


def value_head(hidden_size):
    """The loop's head, the same initial weights wherever it is made."""
    torch.manual_seed(11)
    head = torch.nn.Linear(hidden_size, 1, dtype=torch.float64)
    return head, torch.optim.AdamW(head.parameters(), lr=LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)


def value_loss(values, returns, old_values):
    """PPO's clipped value loss over every token's value [B, T]."""
    clipped = old_values + (values - old_values).clamp(-CLIP_VALUE, CLIP_VALUE)
    return 0.5 * torch.max((values - returns) ** 2, (clipped - returns) ** 2).mean()


def values_of(model, head, ids):
    """Each token's value [B, T] from run.model: the loop's head over the hidden states, or the
    model's own score head (head None)."""
    return model(ids)[..., 0] if head is None else head(model.hidden_states(ids)).squeeze(-1)


def train_critic(run_file, rank, world, own_head):
    """This rank's ((losses, norms), the model's full weights, the loop's head's weights, none
    where the model scores with its own head) after STEPS steps on its rows of every batch."""
    import fsdpp
    run = fsdpp.Run(run_file)
    head, head_optimizer = value_head(run.hidden_size) if own_head else (None, None)
    per_rank = ROWS // world
    rows = slice(rank * per_rank, (rank + 1) * per_rank)
    losses, norms = [], []
    for ids, returns, old_values in batches(run._run.vocab_size):
        loss = value_loss(values_of(run.model, head, ids[rows, :-1]), returns[rows], old_values[rows])
        loss.backward()
        if head is not None and world > 1:  # the loop's head: averaged as the run averages its own
            for p in head.parameters():
                torch.distributed.all_reduce(p.grad)
                p.grad /= world
        norm, stepped = run.step()
        assert stepped
        run.zero_grad()
        if head is not None:
            head_optimizer.step()
            head_optimizer.zero_grad()
        losses.append(loss.item())
        norms.append(norm)
    weights = {name: t.clone() for name, t in run.full_weights(dtype=torch.float64)}
    head_weights = {name: p.detach().clone() for name, p in head.named_parameters()} if head is not None else {}
    return (losses, norms), weights, head_weights


def train_reference(model_dir, own_head):
    """The same loop over transformers' model and torch.optim.AdamW: (losses, norms), the
    initial weights."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification
    auto = AutoModelForCausalLM if own_head else AutoModelForSequenceClassification
    model = auto.from_pretrained(model_dir, dtype=torch.float64)
    initial = {name: t.clone() for name, t in model.state_dict().items()}
    head, head_optimizer = value_head(model.config.hidden_size) if own_head else (None, None)
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": WEIGHT_DECAY},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=LR, betas=(0.9, 0.95), eps=1e-8)
    losses, norms = [], []
    for ids, returns, old_values in batches(model.config.vocab_size):
        loss = 0
        for h in [slice(0, ROWS // 2), slice(ROWS // 2, ROWS)]:  # what two ranks' averaged gradients give
            hidden = model.model(ids[h, :-1]).last_hidden_state
            values = head(hidden).squeeze(-1) if own_head else model.score(hidden)[..., 0]
            loss = loss + value_loss(values, returns[h], old_values[h]) / 2
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item())
        optimizer.step()
        optimizer.zero_grad()
        if head is not None:
            head_optimizer.step()
            head_optimizer.zero_grad()
        losses.append(loss.item())
    return (losses, norms), initial


def same_hidden_states(run_file, model_dir):
    """hidden_states against transformers' last_hidden_state, whole rows and packed documents."""
    import fsdpp
    from transformers import AutoModelForCausalLM
    run = fsdpp.Run(run_file)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64)
    ids = batches(run._run.vocab_size)[0][0][:2, :-1]  # [2, 12]
    got = run.model.hidden_states(ids)
    want = model.model(ids).last_hidden_state
    rows_gap = ((got - want).norm() / want.norm()).item()
    # Row 0 as two documents of 5 and 7 tokens, row 1 as one: each as if alone.
    packed = run.model.hidden_states(ids, document_offsets=torch.tensor([0, 5, 12, 24]))
    alone = torch.cat([model.model(ids[:1, :5]).last_hidden_state, model.model(ids[:1, 5:]).last_hidden_state], 1)
    packed_gap = ((packed[0] - alone[0]).norm() / alone.norm()).item()
    ok = tuple(got.shape) == (2, 12, run.hidden_size) and max(rows_gap, packed_gap) <= FIRST_STEP_BOUND
    print(f"{'ok  ' if ok else 'FAIL'} hidden states {tuple(got.shape)} against transformers' last_hidden_state: "
          f"rows {rows_gap:.1e}, packed documents {packed_gap:.1e} (bound {FIRST_STEP_BOUND:.0e}, relative)")
    return ok


def frozen_and_offloaded(run_file):
    """A frozen run's hidden states equal the trained run's before its step; an offloaded run's
    hidden_states raises fsdpp.Error."""
    import fsdpp
    ids = batches(101)[0][0][:, :-1]
    trained, frozen = fsdpp.Run(run_file), fsdpp.Run(run_file, frozen=True)
    with torch.no_grad():
        same = torch.equal(trained.model.hidden_states(ids), frozen.model.hidden_states(ids))
    trained.offload()
    try:
        trained.model.hidden_states(ids)
        said = "no error"
    except fsdpp.Error as e:
        said = str(e)
    ok = same and "offload" in said
    print(f"{'ok  ' if ok else 'FAIL'} a frozen run's hidden states {'equal' if same else 'DIFFER FROM'} the trained "
          f"run's; while offloaded: {said}")
    return ok


def compare_worlds(name, got, want):
    """World 2's (figures, model weights, head weights) against world 1's."""
    gap = max(max(abs(a - b) for a, b in zip(g, w)) for g, w in zip(got[0], want[0]))
    for mine, theirs in zip(got[1:], want[1:]):
        gap = max([gap] + [(mine[k] - theirs[k]).abs().max().item() for k in theirs])
    ok = gap <= FLOAT64_BOUND and set(got[1]) == set(want[1])
    print(f"{'ok  ' if ok else 'FAIL'} {name}: losses, norms, {len(got[1])} model and {len(got[2])} head weights {gap:.1e} "
          f"from world 1's (bound {FLOAT64_BOUND:.0e})")
    return ok


def untouched_head(name, weights, initial):
    """The untied lm_head, which no backward reached, after STEPS steps: as it was, as torch's
    AdamW leaves a parameter without a gradient."""
    same = torch.equal(weights["lm_head.weight"], initial["lm_head.weight"])
    print(f"{'ok  ' if same else 'FAIL'} {name}: lm_head after {STEPS} steps {'is' if same else 'is NOT'} its "
          f"initial weight, bitwise")
    return same


def make_classifier(model_dir, out_dir):
    """A LlamaForSequenceClassification of one label over `model_dir`'s weights, its score head
    initialised by transformers, saved by transformers."""
    from transformers import AutoModelForSequenceClassification
    torch.manual_seed(5)
    AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=1, dtype=torch.float64).save_pretrained(
        out_dir)
    return out_dir


def scoring_rows(vocab, pad):
    """One row of 12 tokens, none of them the pad token (transformers scores a row at its last
    token that is not one)."""
    ids = batches(vocab)[1][0][:1, :-1].clone()
    if pad is not None:
        ids[ids == pad] = (pad + 1) % vocab
    return ids


def classifier_outside_training(run_file, work):
    """The trained classifier's checkpoint, exported, scores a row in transformers as a frozen
    run of the export does; logprobs and `fsdpp train` refuse the model."""
    import subprocess
    import fsdpp
    from transformers import AutoModelForSequenceClassification
    run = fsdpp.Run(run_file)
    ids = batches(run._run.vocab_size)[0][0]
    run.model(ids).sum().backward()
    run.step()
    saved = run.save(os.path.join(work, "saved"))
    exported = os.path.join(work, "exported")
    subprocess.run([os.environ["FSDPP"], "export", saved, exported], check=True, capture_output=True, timeout=300)
    model = AutoModelForSequenceClassification.from_pretrained(exported, dtype=torch.float64)
    rows = scoring_rows(model.config.vocab_size, model.config.pad_token_id)
    want = model(rows).logits[0, 0].item()  # [1, 1]: the row's last token's score
    with torch.no_grad():
        trained = run.model(rows)[0, -1, 0].item()
    reward = fsdpp.Run(write_run_file(fresh_dir(os.path.join(work, "reward")), exported), frozen=True)
    with torch.no_grad():
        scored = reward.model(rows)[0, -1, 0].item()
    gap = max(abs(trained - want), abs(scored - want)) / abs(want)
    ok = model.config.architectures == ["LlamaForSequenceClassification"] and gap <= FIRST_STEP_BOUND
    print(f"{'ok  ' if ok else 'FAIL'} exported classifier ({model.config.architectures}) scores a row {want:.6f} in "
          f"transformers; the run and a frozen run of the export within {gap:.1e} (bound {FIRST_STEP_BOUND:.0e})")
    try:
        run.model.logprobs(ids[:, :-1], ids[:, 1:])
        said = "no error"
    except fsdpp.Error as e:
        said = str(e)
    trained_by_binary = subprocess.run([os.environ["FSDPP"], "train", run_file], capture_output=True, text=True,
                                       timeout=300)
    refused = trained_by_binary.stderr.strip().splitlines()
    ok_refused = ("score head" in said and trained_by_binary.returncode == 2 and len(refused) == 1 and
                  "LlamaForSequenceClassification (num_labels 1)" in refused[0])
    print(f"{'ok  ' if ok_refused else 'FAIL'} logprobs: {said}; fsdpp train: exit {trained_by_binary.returncode}, "
          f"{refused}")
    return ok and ok_refused


def critic_from_language_model(fixtures, work):
    """A language model's weights under a classifier's config (an actor's base made a critic):
    the score head drawn afresh, normal with std initializer_range as transformers draws it,
    the same in every build, the rest the fixture's."""
    import json
    import shutil
    import fsdpp
    from safetensors.torch import load_file
    model_dir = os.path.join(fresh_dir(work), "model")
    shutil.copytree(os.path.join(fixtures, "llama_untied"), model_dir)
    config = json.load(open(os.path.join(model_dir, "config.json")))
    config.update(architectures=["LlamaForSequenceClassification"], id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0})
    json.dump(config, open(os.path.join(model_dir, "config.json"), "w"))
    run_file = write_run_file(work, model_dir)
    builds = [dict(fsdpp.Run(run_file).full_weights(dtype=torch.float64)) for _ in range(2)]
    score = builds[0]["score.weight"]
    fixture = load_file(os.path.join(model_dir, "model.safetensors"))
    rest = all(torch.equal(t, fixture[n].double()) for n, t in builds[0].items() if n != "score.weight")
    ratio = score.std().item() / config["initializer_range"]
    ok = (tuple(score.shape) == (1, config["hidden_size"]) and torch.equal(score, builds[1]["score.weight"]) and
          0.5 < ratio < 2 and rest)
    print(f"{'ok  ' if ok else 'FAIL'} a language model's weights under a classifier's config: score.weight "
          f"{tuple(score.shape)} drawn afresh, std {ratio:.2f} x initializer_range, the same in two builds; "
          f"the rest {'the' if rest else 'NOT the'} fixture's")
    return ok


def lora_classifier(model_dir, work):
    """LoRA over the classifier: its score head trains beside the adapters, as peft's SEQ_CLS
    task keeps it, with lora_trainable naming it or not."""
    import fsdpp
    moved = []
    for trainable in ("", "score", "model.norm"):
        run = fsdpp.Run(write_run_file(fresh_dir(work), model_dir),
                        {"policy.options.lora_rank": 4, "policy.options.lora_trainable": trainable})
        before = run_weight(run, "score.weight")
        run.model(batches(101)[0][0][:, :-1]).pow(2).mean().backward()
        run.step()
        moved.append(not torch.equal(before, run_weight(run, "score.weight")))
    ok = all(moved)
    print(f"{'ok  ' if ok else 'FAIL'} LoRA over the classifier: score.weight trains "
          f"{'with' if ok else 'NOT with'} lora_trainable unset, \"score\" and \"model.norm\" ({moved})")
    return ok


def run_weight(run, name):
    return dict(run.full_weights(dtype=torch.float64))[name].clone()


def three_runs_rank(actor_file, critic_file, out):
    """An actor, a critic and a frozen reference in one process, one rank of a PPO loop's
    phases: each trained run's figures over 3 steps."""
    import fsdpp
    actor, critic = fsdpp.Run(actor_file), fsdpp.Run(critic_file)
    reference = fsdpp.Run(actor_file, frozen=True)
    rank = actor.rank
    figures = []
    for ids, returns, old_values in batches(actor._run.vocab_size)[:3]:
        mine = ids[rank * 2:(rank + 1) * 2]
        with torch.no_grad():
            kept = reference.model(mine[:, :-1]).log_softmax(-1)
        logp = actor.model(mine[:, :-1]).log_softmax(-1)
        (logp.exp() * (logp - kept)).sum(-1).mean().backward()  # a KL to the reference
        value_loss(critic.model(mine[:, :-1])[..., 0], returns[rank * 2:(rank + 1) * 2],
                   old_values[rank * 2:(rank + 1) * 2]).backward()
        figures.append([actor.step(), critic.step()])
        actor.zero_grad()
        critic.zero_grad()
    torch.save(figures, f"{out}.{rank}.pt")


def three_runs(fixtures, classifier_dir, work):
    """Actor, critic and reference Runs side by side at world 2: each step's figures the same
    on both ranks, every update applied."""
    actor_file = write_run_file(fresh_dir(os.path.join(work, "actor")), os.path.join(fixtures, "llama_untied"))
    critic_file = write_run_file(fresh_dir(os.path.join(work, "critic")), classifier_dir)
    out = os.path.join(work, "three")
    done = run_ranks(__file__, 2, "--three-runs", actor_file, critic_file, out)
    if done.returncode != 0:
        print(f"FAIL actor, critic and reference at world 2: exit {done.returncode}\n{done.stderr[-3000:]}")
        return False
    got = [torch.load(f"{out}.{r}.pt") for r in range(2)]
    ok = got[0] == got[1] and all(stepped for step in got[0] for _, stepped in step)
    print(f"{'ok  ' if ok else 'FAIL'} actor, critic and frozen reference in one process at world 2: 3 steps, "
          f"gradient norms {'the same' if got[0] == got[1] else 'DIFFERENT'} on both ranks "
          f"(last: actor {got[0][-1][0][0]:.4f}, critic {got[0][-1][1][0]:.4f})")
    return ok


def main():
    if sys.argv[1:3] == ["--rank", "--three-runs"]:  # one of torchrun's processes
        three_runs_rank(*sys.argv[3:6])
        return 0
    if sys.argv[1] == "--rank":  # one of torchrun's processes
        run_file, out, own_head = sys.argv[2], sys.argv[3], sys.argv[4] == "own-head"
        torch.distributed.init_process_group("gloo")
        rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
        figures, weights, head = train_critic(run_file, rank, world, own_head)
        torch.save((figures, weights, head), f"{out}.{rank}.pt")
        torch.distributed.destroy_process_group()
        return 0
    fixtures, work = sys.argv[1], sys.argv[2]
    ok = True
    for model in ["llama_untied", "llama_tied_rope3", "classifier"]:
        case_dir = fresh_dir(os.path.join(work, model))
        own_head = model != "classifier"
        model_dir = (os.path.join(fixtures, model) if own_head else
                     make_classifier(os.path.join(fixtures, "llama_untied"), os.path.join(case_dir, "model")))
        run_file = write_run_file(case_dir, model_dir, lr=LR)
        if model == "llama_untied":
            ok &= same_hidden_states(run_file, model_dir)
            ok &= frozen_and_offloaded(run_file)
        want, initial = train_reference(model_dir, own_head)
        one = train_critic(run_file, 0, 1, own_head)
        ok &= compare_transformers(f"{model} critic, world 1", one[0], want)
        out = os.path.join(case_dir, "world2")
        ranks = run_ranks(__file__, 2, run_file, out, "own-head" if own_head else "score-head")
        if ranks.returncode != 0:
            print(f"FAIL {model} critic, world 2: exit {ranks.returncode}\n{ranks.stderr[-3000:]}")
            return 1
        got = [torch.load(f"{out}.{r}.pt") for r in range(2)]
        # Each rank's loss is its half's mean; the step's loss is their average.
        two = ([(a + b) / 2 for a, b in zip(got[0][0][0], got[1][0][0])], got[0][0][1])
        ok &= got[0][0][1] == got[1][0][1]
        ok &= compare_transformers(f"{model} critic, world 2 under torchrun", two, want)
        for r in range(2):
            ok &= compare_worlds(f"{model} critic, world 2 rank {r}", (two, *got[r][1:]), one)
        if model == "llama_untied":
            ok &= untouched_head(f"{model} critic", one[1], initial)
        if model == "classifier":
            ok &= classifier_outside_training(run_file, case_dir)
            ok &= three_runs(fixtures, model_dir, case_dir)
            ok &= critic_from_language_model(fixtures, os.path.join(case_dir, "from-actor"))
            ok &= lora_classifier(model_dir, os.path.join(case_dir, "lora"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
