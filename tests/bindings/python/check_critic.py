"""run.model.hidden_states: a PPO critic's values from fsdpp's hidden states and a head of the
loop's own, against transformers + torch.optim.AdamW in one process.

A value head (torch.nn.Linear(C, 1), the loop's, trained by its own AdamW) on the final hidden
states of a transformers-saved Llama, untied (lm_head its own unit, never run) and tied, with
PPO's clipped value loss, for 5 steps in float64:
- the hidden states equal transformers' last_hidden_state (1e-6 relative: transformers
  computes its rotary tables in float32), packed documents each their own;
- losses and gradient norms against transformers as check_python_run.py bounds them; world 2
  (torchrun; the head's gradient averaged over the ranks by torch.distributed, beside the
  run's own groups) against world 1 within 1e-10, the head's weights and the model's;
- the untied lm_head, which such a loss leaves a gradient of zeros, shrunk by AdamW's weight
  decay alone, as docs/python.md says;
- a frozen run's hidden states (a reward model's features) equal the trained run's before it
  steps; hidden_states while the params are offloaded raises fsdpp.Error.

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


def train_critic(run_file, rank, world):
    """This rank's ((losses, norms), the model's full weights, the head's weights) after STEPS
    steps on its rows of every batch."""
    import fsdpp
    run = fsdpp.Run(run_file)
    head, head_optimizer = value_head(run.hidden_size)
    per_rank = ROWS // world
    rows = slice(rank * per_rank, (rank + 1) * per_rank)
    losses, norms = [], []
    for ids, returns, old_values in batches(run._run.vocab_size):
        values = head(run.model.hidden_states(ids[rows, :-1])).squeeze(-1)  # [B, T]
        loss = value_loss(values, returns[rows], old_values[rows])
        loss.backward()
        if world > 1:  # the head is the loop's: its gradient is averaged as the run averages its own
            torch.distributed.all_reduce(head.weight.grad)
            torch.distributed.all_reduce(head.bias.grad)
            for p in head.parameters():
                p.grad /= world
        norm, stepped = run.step()
        assert stepped
        head_optimizer.step()
        run.zero_grad()
        head_optimizer.zero_grad()
        losses.append(loss.item())
        norms.append(norm)
    weights = {name: t.clone() for name, t in run.full_weights(dtype=torch.float64)}
    return (losses, norms), weights, {name: p.detach().clone() for name, p in head.named_parameters()}


def train_reference(model_dir):
    """The same loop over transformers' model and torch.optim.AdamW: (losses, norms), the
    initial weights."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64)
    initial = {name: t.clone() for name, t in model.state_dict().items()}
    head, head_optimizer = value_head(model.config.hidden_size)
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": WEIGHT_DECAY},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=LR, betas=(0.9, 0.95), eps=1e-8)
    losses, norms = [], []
    for ids, returns, old_values in batches(model.config.vocab_size):
        loss = 0
        for h in [slice(0, ROWS // 2), slice(ROWS // 2, ROWS)]:  # what two ranks' averaged gradients give
            values = head(model.model(ids[h, :-1]).last_hidden_state).squeeze(-1)
            loss = loss + value_loss(values, returns[h], old_values[h]) / 2
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item())
        optimizer.step()
        head_optimizer.step()
        optimizer.zero_grad()
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
    print(f"{'ok  ' if ok else 'FAIL'} {name}: losses, norms, {len(got[1])} model and 2 head weights {gap:.1e} "
          f"from world 1's (bound {FLOAT64_BOUND:.0e})")
    return ok


def decayed_head(name, weights, initial):
    """The untied lm_head after STEPS steps of zero gradients: AdamW's decay alone."""
    want = initial["lm_head.weight"] * (1 - LR * WEIGHT_DECAY) ** STEPS
    gap = ((weights["lm_head.weight"] - want).norm() / want.norm()).item()
    ok = gap <= FLOAT64_BOUND
    print(f"{'ok  ' if ok else 'FAIL'} {name}: lm_head after {STEPS} steps is its initial weight times "
          f"(1 - lr * weight_decay)^{STEPS} within {gap:.1e} (bound {FLOAT64_BOUND:.0e})")
    return ok


def main():
    if sys.argv[1] == "--rank":  # one of torchrun's processes
        run_file, out = sys.argv[2:4]
        torch.distributed.init_process_group("gloo")
        rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
        figures, weights, head = train_critic(run_file, rank, world)
        torch.save((figures, weights, head), f"{out}.{rank}.pt")
        torch.distributed.destroy_process_group()
        return 0
    fixtures, work = sys.argv[1], sys.argv[2]
    ok = True
    for model in ["llama_untied", "llama_tied_rope3"]:
        case_dir = fresh_dir(os.path.join(work, model))
        model_dir = os.path.join(fixtures, model)
        run_file = write_run_file(case_dir, model_dir, lr=LR)
        if model == "llama_untied":
            ok &= same_hidden_states(run_file, model_dir)
            ok &= frozen_and_offloaded(run_file)
        want, initial = train_reference(model_dir)
        one = train_critic(run_file, 0, 1)
        ok &= compare_transformers(f"{model} critic, world 1", one[0], want)
        out = os.path.join(case_dir, "world2")
        ranks = run_ranks(__file__, 2, run_file, out)
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
            ok &= decayed_head(f"{model} critic", one[1], initial)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
