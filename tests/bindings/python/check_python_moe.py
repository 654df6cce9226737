"""Mixture-of-experts models driven from Python: the load-balancing loss and the routing-bias
update happen inside fsdpp.Run, as in the binary, without the loop writing either.

- Qwen3-MoE (router_aux_loss_coef 0.05), float64, a cross-entropy the loop computes from
  run.model's logits: against transformers with the same cross-entropy plus 0.05 × its
  aux_loss, the first step's loss and gradient norm within 1e-6 relative and the later
  losses within 1e-3 (transformers' float32 rotary tables; see check_python_run.py); and at
  world 2 under torchrun, gradients averaged, equal to world 1 within 1e-10 (each rank's
  share of the load-balancing loss survives the average); the run file's [train] grad_accum,
  the binary's own loop's, does not divide the weight of the loop's forwards;
- a second forward with autograd before the first one's backward is refused, and a forward
  whose output was dropped is no such forward;
- DeepSeek-V3 with [experts] bias_update_rate: world 2 equal to world 1 within 1e-10, the
  routing biases included, each bias having moved by whole multiples of the rate.

usage: check_python_moe.py FIXTURE_DIR WORK_DIR
"""
import os
import subprocess
import sys

import torch

from check_python_run import ROWS, backward_and_step, batches, compare_transformers, compare_worlds, write_run_file

STEPS = 3
BIAS_RATE = 1e-3
# The binary's [train] grad_accum divides its own micro-batches' weights; a loop's forwards
# each carry the whole weight whatever it says.
OVERRIDES = {"qwen3_moe": {"train.grad_accum": 4}, "deepseek_v3": {"experts.bias_update_rate": BIAS_RATE}}


def cross_entropy(logits, ids):
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).double(), ids[:, 1:].reshape(-1))


def train_fsdpp(run_file, model, rank, world):
    """This rank's ((losses, grad norms), full weights after STEPS steps) on its rows."""
    import fsdpp
    run = fsdpp.Run(run_file, OVERRIDES[model])
    losses, norms = [], []
    per_rank = ROWS // world
    for ids, _, _ in batches(101)[:STEPS]:
        mine = ids[rank * per_rank:(rank + 1) * per_rank]
        backward_and_step(run, cross_entropy(run.model(mine[:, :-1]), mine), losses, norms)
    return (losses, norms), {name: t.clone() for name, t in run.full_weights(dtype=torch.float64)}


def train_reference(model_dir):
    """transformers: the loop's cross-entropy plus router_aux_loss_coef × aux_loss, AdamW as the run file's."""
    from transformers import AutoModelForCausalLM
    # One product per expert: transformers' grouped kernel takes no float64.
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64, experts_implementation="eager")
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                                  lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    losses, norms = [], []
    for ids, _, _ in batches(101)[:STEPS]:
        out = model(ids[:, :-1], output_router_logits=True)
        loss = cross_entropy(out.logits, ids)
        (loss + model.config.router_aux_loss_coef * out.aux_loss).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, norms


def biases_moved_by_the_rate(before, after):
    """Every e_score_correction_bias moved, each element by a whole multiple of the rate."""
    names = [k for k in after if k.endswith("e_score_correction_bias")]
    steps = [((after[k] - before[k]) / BIAS_RATE) for k in names]
    whole = all(((s - s.round()).abs() < 1e-6).all() for s in steps)
    moved = all((s.abs() > 0.5).any() for s in steps)
    ok = bool(names) and whole and moved
    print(f"{'ok  ' if ok else 'FAIL'} deepseek_v3: {len(names)} routing biases moved by whole multiples of "
          f"bias_update_rate {BIAS_RATE:g} over {STEPS} steps")
    return ok


def second_forward_refused(run_file):
    """A second forward with autograd before the first one's backward would replace its
    load-balancing gradient: refused in one line, and the run trains on after it; sampling
    under no_grad between two training forwards is no such forward."""
    import fsdpp
    run = fsdpp.Run(run_file)
    ids = batches(101)[0][0]
    first = run.model(ids)
    try:
        run.model(ids)
        message = "no error"
    except fsdpp.Error as e:
        message = str(e)
    with torch.no_grad():
        run.model(ids)
    first.sum().backward()
    second = run.model(ids)  # after the backward: allowed
    second.sum().backward()
    norm, stepped = run.step()
    ok = (message.startswith("forward: a mixture-of-experts model's forward with autograd before the backward")
          and "\n" not in message and stepped and norm > 0)
    print(f"{'ok  ' if ok else 'FAIL'} a second forward with autograd before the first's backward: {message}; "
          f"then a step of norm {norm:.6f}")
    # A forward whose output is gone (a loss that raised, logits detached) has no backward to
    # come: the next forward trains, and its step is a fresh run's.
    head_in_root = {"policy.options.fused_linear_logprob": True}  # for logprobs
    run, fresh = fsdpp.Run(run_file, head_in_root), fsdpp.Run(run_file, head_in_root)
    run.model(ids).detach()
    run.model.logprobs(ids[:, :-1], ids[:, 1:]).detach()
    dropped = []
    for r in (run, fresh):
        r.model(ids).sum().backward()
        dropped.append(r.step())
    good = dropped[0] == dropped[1]
    ok &= good
    print(f"{'ok  ' if good else 'FAIL'} forwards dropped before their backward, then a forward, backward and step: "
          f"{dropped[0]}, a fresh run's {dropped[1]}")
    # A retained graph backpropagated again after a later forward would read that forward's
    # load-balancing gradient: refused.
    run = fsdpp.Run(run_file)
    first = run.model(ids).sum()
    first.backward(retain_graph=True)
    run.model(ids).sum().backward()
    try:
        first.backward()
        late = "no error"
    except RuntimeError as e:
        late = str(e)
    good = late.startswith("backward: through a mixture-of-experts model's forward made before the latest forward")
    ok &= good
    print(f"{'ok  ' if good else 'FAIL'} a retained graph backpropagated after a later forward: {late}")
    return ok


def main():
    if sys.argv[1] == "--rank":  # one of torchrun's processes
        run_file, model, out = sys.argv[2:5]
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        figures, weights = train_fsdpp(run_file, model, rank, world)
        torch.save({"figures": figures, "weights": weights}, f"{out}.{rank}.pt")
        return 0
    fixtures, work = sys.argv[1], sys.argv[2]
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    ok = True
    for model in ["qwen3_moe", "deepseek_v3"]:
        model_dir = os.path.join(fixtures, model)
        os.makedirs(os.path.join(work, model), exist_ok=True)
        run_file = write_run_file(os.path.join(work, model), model_dir)
        one = train_fsdpp(run_file, model, 0, 1)
        if model == "qwen3_moe":
            ok &= second_forward_refused(run_file)
            ok &= compare_transformers(f"{model}, world 1, aux loss inside the run", one[0], train_reference(model_dir))
        else:
            from safetensors.torch import load_file
            initial = load_file(os.path.join(model_dir, "model.safetensors"))
            ok &= biases_moved_by_the_rate({k: v.double() for k, v in initial.items()}, one[1])
        out = os.path.join(work, model, "world2")
        subprocess.run([torchrun, "--standalone", "--nproc-per-node", "2", __file__, "--rank", run_file, model, out],
                       check=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
        ranks = [torch.load(f"{out}.{r}.pt") for r in range(2)]
        losses = [(a + b) / 2 for a, b in zip(ranks[0]["figures"][0], ranks[1]["figures"][0])]
        for r in range(2):
            ok &= compare_worlds(f"{model}, world 2 rank {r}", ((losses, ranks[r]["figures"][1]), ranks[r]["weights"]), one)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
