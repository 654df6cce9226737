"""At world 2, an error on one rank alone never leaves the ranks' collectives out of step.

Under torchrun, two ranks of one Run over the llama_untied fixture:
- inputs refused on one rank (a token past the vocabulary, an argument the package refuses,
  a temperature out of range, a learning rate the package refuses, out of range or past a
  float's, a save over a checkpoint only that rank's directory holds, a save's directory the
  package refuses, an offload of a state that is none, full weights in integers): every rank
  raises, the refusing one its own message
  and the other one naming it, and the run goes on in step (the next step's gradient norm is
  the same on both ranks); so does an error every rank's state raises alike (an offload
  while offloaded), learning rates that differ between the ranks, and ranks in different
  calls (a step on one, a forward on the other; a backward on one, a step on the other), each
  naming the other's call;
- a hook of the loop's that raises in one rank's backward: that rank refuses every later call,
  naming why; the other's backward fails in its collective (or its next call does, where the
  failed collective was a prefetch), after which it refuses every call too; and both
  processes end cleanly (no abort from collectives that differ).

usage: check_rank_errors.py FIXTURE_DIR WORK_DIR
"""
import json
import os
import sys

from check_python_run import ROWS, batches, fresh_dir, run_ranks, write_run_file


def rank_main(run_file, work):
    import fsdpp
    import torch
    rank = int(os.environ["RANK"])
    run = fsdpp.Run(run_file, {"parallel.timeout_s": 60, "policy.options.fused_linear_logprob": True})
    mine = batches(101)[0][0][rank * ROWS // 2:(rank + 1) * ROWS // 2, :-1]
    seen = {}

    def attempt(name, call):
        try:
            call()
            seen[name] = "no error"
        except Exception as e:  # fsdpp.Error, and what torch's backward raises
            seen[name] = str(e)

    past_vocab = mine.clone()
    past_vocab[0, 0] = 101
    attempt("vocabulary", lambda: run.model(past_vocab if rank == 1 else mine))
    attempt("package", lambda: run.model(mine.tolist() if rank == 0 else mine))
    attempt("temperature", lambda: run.model.logprobs(mine, mine, temperature=0.0 if rank == 1 else 1.0))
    own_dir = os.path.join(work, f"saves-{rank}")
    if rank == 1:
        os.makedirs(os.path.join(own_dir, "step-00000000"))
    attempt("save", lambda: run.save(own_dir))
    attempt("package save", lambda: run.save(3 if rank == 1 else own_dir))
    attempt("offload name", lambda: run.offload(("params",) if rank == 0 else ("parms",)))
    attempt("full weights dtype", lambda: list(run.full_weights(dtype=torch.int32 if rank == 1 else torch.float32)))
    run.offload(("grads",))
    attempt("offload twice", lambda: run.offload(("grads",)))  # every rank's state says so alike
    run.reload()
    run.model(mine).logsumexp(-1).mean().backward()
    attempt("lr package", lambda: run.step(lr="fast" if rank == 0 else 1e-3))
    attempt("lr range", lambda: run.step(lr=float("nan") if rank == 1 else 1e-3))
    attempt("lr differs", lambda: run.step(lr=1e-3 if rank == 0 else None))
    attempt("lr past a float", lambda: run.step(lr=-10**400 if rank == 1 else 1e-3))
    attempt("calls differ", run.step if rank == 0 else lambda: run.model(mine))
    skipped = run.model(mine)  # a loop that skips rank 1's backward (no rows of its own to learn)
    attempt("backward skipped", (lambda: skipped.logsumexp(-1).mean().backward()) if rank == 0 else run.step)
    seen["step"] = list(run.step(lr=run.scheduled_lr))

    run.zero_grad()
    logits = run.model(mine)
    if rank == 1:
        def hook(grad):
            raise ValueError("the loop's hook")
        logits.register_hook(hook)
    attempt("raising backward", lambda: logits.logsumexp(-1).mean().backward())
    attempt("after", run.zero_grad)
    attempt("again", run.zero_grad)
    json.dump(seen, open(os.path.join(work, f"seen.{rank}"), "w"))


def main():
    if sys.argv[1] == "--rank":
        rank_main(sys.argv[2], sys.argv[3])
        return 0
    fixtures, work = sys.argv[1], sys.argv[2]
    fresh_dir(work)
    run_file = write_run_file(work, os.path.join(fixtures, "llama_untied"))
    done = run_ranks(__file__, 2, run_file, work)
    if done.returncode != 0 or "terminate called" in done.stderr:
        print(done.stdout + done.stderr)
        print(f"FAIL the ranks ended with status {done.returncode}")
        return 1
    seen = [json.load(open(os.path.join(work, f"seen.{r}"))) for r in range(2)]
    refused = "'s inputs were refused (its error says why); every rank raises, and the run goes on"
    out_of_step = "is out of step with the other ranks since an error not every rank raised"
    saved_twice = os.path.join(work, "saves-1", "step-00000000")

    def refused_on(rank, key, said, call, prefix=False):
        """Rank `rank` raised its own error for `key` (`said`, or one starting so), and the other
        rank the agreed refusal of `call` naming it."""
        own = seen[rank][key]
        return (own.startswith(said) if prefix else own == said) and \
            seen[1 - rank][key] == f"{call}: rank {rank}" + refused

    checks = [
        ("a token past the vocabulary on rank 1",
         refused_on(1, "vocabulary", "input_ids: token ids must be in [0, 101), got 101", "run.model")),
        ("an argument the package refuses on rank 0",
         refused_on(0, "package", "input_ids: expected a torch.Tensor, got list", "run.model")),
        ("a temperature out of range on rank 1",
         refused_on(1, "temperature", "temperature: must be a positive number", "run.model.logprobs", prefix=True)),
        ("a save over a checkpoint rank 1 alone sees",
         refused_on(1, "save", f"save: {saved_twice} exists already; save to another directory or remove it", "save")),
        ("a save's directory the package refuses on rank 1",
         refused_on(1, "package save", "save: expected a str, bytes or path, got int", "save")),
        ("a learning rate the package refuses on rank 0",
         refused_on(0, "lr package", "step: lr must be a number in [0, 1e6], got str", "step")),
        ("a learning rate out of range on rank 1",
         refused_on(1, "lr range", "step: lr must be a number in [0, 1e6], got nan", "step")),
        ("a learning rate on rank 0 and the schedule's on rank 1",
         all(seen[r]["lr differs"] == "step: rank 1 gave lr none (the [scheduler]'s) and rank 0 0.001: every rank "
             "steps at one rate" for r in range(2))),
        ("a learning rate past a float's range on rank 1",
         refused_on(1, "lr past a float", "step: lr must be a number in [0, 1e6], got an integer of 401 digits", "step")),
        ("a step on rank 0 and a forward on rank 1",
         seen[0]["calls differ"].startswith("step: rank 1 is in run.model where this rank is in step") and
         seen[1]["calls differ"].startswith("run.model: rank 0 is in step where this rank is in run.model")),
        ("a backward on rank 0 and a step on rank 1, at once rather than at the timeout",
         seen[0]["backward skipped"].startswith("backward: rank 1 is in step where this rank is in backward") and
         seen[1]["backward skipped"].startswith("step: rank 0 is in backward where this rank is in step")),
        ("an offload of a state that is none on rank 1",
         refused_on(1, "offload name", "offload: 'parms' is not one of params, grads, optimizer", "offload")),
        ("full weights in integers on rank 1",
         refused_on(1, "full weights dtype", "full_weights: dtype must be a floating torch.dtype, got torch.int32",
                    "full_weights")),
        ("an offload twice on every rank, which leaves the ranks in step",
         all(seen[r]["offload twice"] == "offload: offload() moved the run's grads off the device already; reload() "
             "first" for r in range(2))),
        ("the next step in step on both ranks", seen[0]["step"] == seen[1]["step"] and seen[0]["step"][1] is True),
        ("a hook raising in rank 1's backward",
         seen[1]["raising backward"] == "the loop's hook" and seen[0]["raising backward"] != "no error"),
        ("every later call refused on both ranks",
         all(seen[r]["after"] != "no error" and seen[r]["again"].startswith(f"rank {r} {out_of_step}")
             for r in range(2))),
    ]
    for name, ok in checks:
        print(f"{'ok  ' if ok else 'FAIL'} {name}")
    for r in range(2):
        print(f"     rank {r}: {json.dumps(seen[r])}")
    return 0 if all(ok for _, ok in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
