"""fsdpp.Run against PyTorch's own FSDP2, both at world 2 under torchrun on the CPU, in float32.

The same transformers-saved Llama, the same rows and the same Python loss for 5 steps: first
a DPO-style margin on log-probabilities (fsdpp's chunked run.model.logprobs at a temperature,
the peer's log_softmax of its full logits), then a clipped ratio on log-probabilities taken
from the logits, then that ratio again with zero_grad after every second step alone and no
clip (a gradient kept across a step must be divided over the ranks once, as FSDP2's is). The
peer is transformers + fully_shard on every decoder layer and the root,
gradients averaged over the ranks (FSDP2's default), one global clip and torch.optim.AdamW
with the same hyperparameters. Each rank computes the mean loss over its own rows, as a loop
written for FSDP2 does. Each step's loss and gradient norm agree within 1e-5 (relative, or
absolute below 1), and so does every weight tensor after the last step (the L2 norm of its gap
over its own). Float32 sets that bound: a DPO margin is a difference of sums of 12
log-probabilities near -5, whose rounding alone moves the loss by about 2e-6 before either
engine chooses anything, and another CPU's kernels round apart again. A wrong learning rate,
decay, average or clip moves a figure or a weight by 5e-5 or more. The learning rate is
1e-4: AdamW moves each weight by about the learning rate whatever its gradient's size, so a
gradient element near AdamW's eps, whose float32 rounding differs between the engines, makes
its weight differ by up to a tenth of a step; the largest such element gap is printed.

usage: check_python_fully_shard.py FIXTURE_DIR WORK_DIR
"""
import os
import subprocess
import sys

import torch

from check_python_run import (LOSSES, ROWS, STEPS, TEMPERATURE, backward_and_step, batches, full_logprobs,
                              write_run_file)

BOUND = 1e-5  # float32: see above
LR, WEIGHT_DECAY, BETAS, CLIP = 1e-4, 0.1, (0.9, 0.95), 1.0  # the run file's, LR ours


def rank_rows(rank, world, *tensors):
    per_rank = ROWS // world
    return [t[rank * per_rank:(rank + 1) * per_rank] for t in tensors]


# case -> (loss, whether gradients are kept across every second step, unclipped)
CASES = {"dpo-margin": ("dpo-margin", False), "clipped-ratio": ("clipped-ratio", False),
         "kept-gradients": ("clipped-ratio", True)}


def fsdpp_worker(run_file, case, out):
    import fsdpp
    loss_name, keep = CASES[case]
    loss_of, chunked = LOSSES[loss_name]
    run = fsdpp.Run(run_file, {"policy.options.fused_linear_logprob": chunked,
                               **({"train.clip_grad_norm": 0.0} if keep else {})})
    losses, norms = [], []
    for step, (ids, advantages, offsets) in enumerate(batches(101)):
        ids, advantages, offsets = rank_rows(run.rank, run.world_size, ids, advantages, offsets)
        if chunked:
            logp = run.model.logprobs(ids[:, :-1], ids[:, 1:], temperature=TEMPERATURE)
        else:
            logp = full_logprobs(run.model(ids[:, :-1]), ids)
        loss = loss_of(logp.double(), advantages, offsets)
        if not keep:
            backward_and_step(run, loss, losses, norms)
            continue
        loss.backward()
        norm, _ = run.step()
        if step % 2 == 1:
            run.zero_grad()
        losses.append(loss.item())
        norms.append(norm)
    weights = {name: t.clone() for name, t in run.full_weights(dtype=torch.float32)}
    torch.save({"figures": list(zip(losses, norms)), "weights": weights}, f"{out}.{run.rank}.pt")


def peer_worker(model_dir, case, out):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": WEIGHT_DECAY},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=LR, betas=BETAS, eps=1e-8)
    loss_name, keep = CASES[case]
    loss_of, chunked = LOSSES[loss_name]
    figures = []
    for step, (ids, advantages, offsets) in enumerate(batches(101)):
        ids, advantages, offsets = rank_rows(rank, world, ids, advantages, offsets)
        logits = model(ids[:, :-1]).logits
        if chunked:  # in float32, as fsdpp's chunks compute
            logp = torch.log_softmax(logits / TEMPERATURE, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        else:
            logp = full_logprobs(logits, ids)
        loss = loss_of(logp.double(), advantages, offsets)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf") if keep else CLIP).full_tensor().item()
        optimizer.step()
        if not keep or step % 2 == 1:
            optimizer.zero_grad()
        figures.append((loss.item(), norm))
    weights = {name: p.full_tensor().detach() for name, p in model.named_parameters()}
    torch.save({"figures": figures, "weights": weights}, f"{out}.{rank}.pt")
    dist.destroy_process_group()


def compare(case, got, want):
    """Rank by rank: each step's loss and gradient norm, then each weight tensor after the last
    step, by the L2 norm of its gap over its own."""
    ok = True
    for rank in range(2):
        g, w = got[rank], want[rank]
        figure_gap = max(abs(a - b) / max(abs(b), 1.0) for s, t in zip(g["figures"], w["figures"]) for a, b in zip(s, t))
        # A tied model's lm_head.weight is its embedding's, which full_weights names once.
        names = set(g["weights"]) in (set(w["weights"]), set(w["weights"]) - {"lm_head.weight"})
        weight_gap = max(((g["weights"][k] - w["weights"][k]).norm() / w["weights"][k].norm()).item() for k in g["weights"])
        largest = max((g["weights"][k] - w["weights"][k]).abs().max().item() for k in g["weights"])
        good = names and len(g["figures"]) == STEPS and max(figure_gap, weight_gap) <= BOUND
        ok &= good
        print(f"{'ok  ' if good else 'FAIL'} {case}, rank {rank}: {STEPS} steps' losses "
              f"{g['figures'][0][0]:.6f} .. {g['figures'][-1][0]:.6f} and norms {figure_gap:.1e} from fully_shard's, "
              f"{len(g['weights'])} weights {weight_gap:.1e} (bound {BOUND:.0e}; largest element gap {largest:.1e} "
              f"against a step of {LR:.0e})")
    return ok


def main():
    if sys.argv[1] == "--fsdpp":
        return fsdpp_worker(*sys.argv[2:5])
    if sys.argv[1] == "--peer":
        return peer_worker(*sys.argv[2:5])
    fixtures, work = sys.argv[1], sys.argv[2]
    model_dir = os.path.join(fixtures, "llama_untied")
    os.makedirs(work, exist_ok=True)
    run_file = write_run_file(work, model_dir, dtype="float32", lr=LR)
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    ok = True
    for case in CASES:
        runs = {}
        for engine, source in [("fsdpp", run_file), ("peer", model_dir)]:
            out = os.path.join(work, f"{case}-{engine}")
            subprocess.run([torchrun, "--standalone", "--nproc-per-node", "2", __file__, f"--{engine}", source,
                            case, out], check=True, timeout=300, env=env)
            runs[engine] = [torch.load(f"{out}.{r}.pt") for r in range(2)]
        ok &= compare(case, runs["fsdpp"], runs["peer"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
