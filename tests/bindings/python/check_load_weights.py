"""load_weights: a reference model refreshed from the actor, and mixed towards it.

Over the llama_untied fixture (made by transformers), in float64:
- a frozen reference loads the full weights of an actor trained 2 steps: its full weights are
  then the actor's bitwise, and its log-probabilities the actor's (both in eval());
- mixed towards the actor (ref = 0.6 actor + 0.4 ref, as a loop that syncs its reference
  softly writes it): its full weights are that mixture bitwise;
- a trained run that loads them takes, bitwise, the next step of a run built from them saved as
  its model (the same weights, fresh moments);
- at world 2 under torchrun, each rank loading the full tensors: the reference equals the
  actor on every rank, and its weights world 1's; ranks that give other names, or fewer
  pairs, or whose iterator raises on one of them, all raise fsdpp.Error, none waiting on the
  other, and the weights stay;
- a name the model lacks, a tied head's lm_head.weight, a tensor of another shape, of
  integers or holding a NaN, a run with LoRA adapters and an offloaded run raise fsdpp.Error, leaving the
  weights as they were; so does iterating a run's own full_weights into it.

usage: check_load_weights.py FIXTURE_DIR WORK_DIR
"""
import os
import sys

import torch

from check_python_run import ROWS, batches, fresh_dir, refusals_hold, refused_while_offloaded, world_2_results, write_run_file

BOUND = 1e-10  # float64, world 2 against world 1


def trained_actor(run_file, rank=0, world=1):
    """An actor after 2 steps of cross-entropy on its rows of each batch."""
    import fsdpp
    actor = fsdpp.Run(run_file)
    per_rank = ROWS // world
    for ids, _, _ in batches(101)[:2]:
        mine = ids[rank * per_rank:(rank + 1) * per_rank]
        logits = actor.model(mine[:, :-1])
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), mine[:, 1:].flatten()).backward()
        actor.step()
        actor.zero_grad()
    return actor


def weights_of(run):
    return {name: t.clone() for name, t in run.full_weights(dtype=torch.float64)}


def logprobs_of(run):
    """Log-probabilities of a held-out batch's rows, from the full logits in eval()."""
    ids = batches(101)[4][0]
    with torch.no_grad():
        logits = run.model.eval()(ids[:, :-1])
    return torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)


def same_weights(a, b):
    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def refresh_and_mix(run_file):
    import fsdpp
    actor = trained_actor(run_file)
    ref = fsdpp.Run(run_file, frozen=True)
    before = weights_of(ref)
    ref.load_weights(actor.full_weights(dtype=torch.float64))
    actor_weights = weights_of(actor)
    refreshed = same_weights(weights_of(ref), actor_weights) and torch.equal(logprobs_of(ref), logprobs_of(actor))
    moved = max((before[k] - actor_weights[k]).abs().max().item() for k in before)

    fresh = fsdpp.Run(run_file, frozen=True)
    ref_weights = weights_of(fresh)
    fresh.load_weights((name, 0.6 * t + 0.4 * ref_weights[name]) for name, t in actor.full_weights(dtype=torch.float64))
    mixed = same_weights(weights_of(fresh), {k: 0.6 * actor_weights[k] + 0.4 * ref_weights[k] for k in ref_weights})
    ok = refreshed and mixed and moved > 1e-3
    print(f"{'ok  ' if refreshed else 'FAIL'} a frozen reference refreshed from the actor (trained 2 steps, weights "
          f"moved up to {moved:.1e}): its full weights and log-probabilities {'are' if refreshed else 'are NOT'} "
          "the actor's, bitwise")
    print(f"{'ok  ' if mixed else 'FAIL'} mixed 0.6 actor + 0.4 reference: {'bitwise' if mixed else 'NOT'} the "
          "mixture")
    return ok


def loaded_run_steps_alike(run_file, fixtures, work):
    """A trained run built from the fixture that loads the actor's weights, and one built from
    those weights saved as its model: the same next step, bitwise."""
    import shutil

    import fsdpp
    from safetensors.torch import save_file
    actor = trained_actor(run_file)
    weights = weights_of(actor)
    model_dir = fresh_dir(os.path.join(work, "as-model"))
    for name in ("config.json", "generation_config.json"):
        if os.path.exists(os.path.join(fixtures, "llama_untied", name)):
            shutil.copy(os.path.join(fixtures, "llama_untied", name), model_dir)
    save_file({k: v.contiguous() for k, v in weights.items()}, os.path.join(model_dir, "model.safetensors"))
    loaded = fsdpp.Run(run_file)
    loaded.load_weights(actor.full_weights(dtype=torch.float64))
    built = fsdpp.Run(write_run_file(fresh_dir(os.path.join(work, "built")), model_dir))
    ids = batches(101)[3][0]
    norms = []
    for run in (loaded, built):
        logits = run.model(ids[:, :-1])
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten()).backward()
        norms.append(run.step()[0])
    same = norms[0] == norms[1] and same_weights(weights_of(loaded), weights_of(built))
    print(f"{'ok  ' if same else 'FAIL'} a trained run that loads the actor's weights takes the step of one built "
          f"from them: gradient norms {norms[0]:.12f} and {norms[1]:.12f}, weights after it "
          f"{'bitwise equal' if same else 'DIFFERENT'}")
    return same


# Pairs that differ between the two ranks, and what each rank must raise: (rank 0's, rank 1's).
MISMATCHES = {
    "other names": ("every rank gives the same pairs",) * 2,
    "fewer pairs on rank 1": ("rank 1 gave no more pairs where rank 0 gave 'model.embed_tokens.weight'",) * 2,
    "an iterator that raises on rank 1": ("rank 1's inputs were refused", "taking the next pair raised KeyError"),
}


def mismatched_loads(ref, rank):
    """This rank's error for each of MISMATCHES (None where none came), and whether the
    weights stayed as they were (a pair the ranks agree on loads the values it had)."""
    import fsdpp
    before = weights_of(ref)
    embed = ("model.embed_tokens.weight", before["model.embed_tokens.weight"])
    gate, up = "model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight"

    def raising():
        yield embed
        if rank == 1:
            raise KeyError("a key the loop lacks")
        yield embed

    calls = [lambda: ref.load_weights({(gate, up)[rank]: torch.full_like(before[gate], 7.0)}),
             lambda: ref.load_weights([embed] * (2 - rank)),
             lambda: ref.load_weights(raising())]
    errors = []
    for call in calls:
        try:
            call()
            errors.append(None)
        except fsdpp.Error as e:
            errors.append(str(e))
    return errors, same_weights(weights_of(ref), before)


def world_rank(run_file, out):
    import fsdpp
    actor = trained_actor(run_file, int(os.environ["RANK"]), 2)
    ref = fsdpp.Run(run_file, frozen=True)
    ref.load_weights(actor.full_weights(dtype=torch.float64))
    torch.save((weights_of(ref), torch.equal(logprobs_of(ref), logprobs_of(actor)), mismatched_loads(ref, actor.rank)),
               f"{out}.{actor.rank}.pt")


def at_world_2(run_file, work):
    # World 1 over the same global batches: the actor's steps take every row.
    want = weights_of(trained_actor(run_file))
    got = world_2_results(__file__, os.path.join(work, "world-2"), run_file)
    if got is None:
        return False
    gap = max((got[0][0][k] - want[k]).abs().max().item() for k in want)
    ok = all(equal for _, equal, _ in got) and gap <= BOUND
    print(f"{'ok  ' if ok else 'FAIL'} world 2: each rank's reference loaded from the actor gives the actor's "
          f"log-probabilities ({[equal for _, equal, _ in got]}); its weights {gap:.1e} from world 1's (bound {BOUND:.0e})")
    for i, (what, wanted) in enumerate(MISMATCHES.items()):
        errors = [got[rank][2][0][i] for rank in range(2)]
        raised = all(e is not None and w in e for e, w in zip(errors, wanted))
        ok &= raised
        print(f"{'ok  ' if raised else 'FAIL'} world 2, {what}: rank 0 raised {errors[0]!r}; rank 1 {errors[1]!r}")
    kept = all(got[rank][2][1] for rank in range(2))
    ok &= kept
    print(f"{'ok  ' if kept else 'FAIL'} world 2: after those the weights are {'as they were' if kept else 'CHANGED'}")
    return ok


def refusals(run_file, fixtures, work):
    import fsdpp
    run = fsdpp.Run(run_file, frozen=True)
    before = weights_of(run)
    embed = before["model.embed_tokens.weight"]
    tied = fsdpp.Run(write_run_file(fresh_dir(os.path.join(work, "tied")), os.path.join(fixtures, "llama_tied_rope3")),
                     frozen=True)
    lora = fsdpp.Run(run_file, {"policy.options.lora_rank": 4})
    norm_with_nan = before["model.norm.weight"].index_fill(0, torch.tensor([3]), float("nan"))
    cases = [
        ("a name the model lacks", lambda: run.load_weights([("model.layers.9.mlp.up_proj.weight", embed)]),
         "no parameter 'model.layers.9.mlp.up_proj.weight'"),
        ("another shape", lambda: run.load_weights({"model.embed_tokens.weight": embed[:5]}),
         "'model.embed_tokens.weight' is Double [5, 48]"),
        ("integers", lambda: run.load_weights({"model.embed_tokens.weight": embed.long()}), "where the parameter is a floating"),
        ("a NaN", lambda: run.load_weights({"model.norm.weight": norm_with_nan}),
         "load_weights: 'model.norm.weight' holds NaN or inf"),
        ("not pairs", lambda: run.load_weights([embed]), "expected (name, tensor) pairs"),
        ("a tied head", lambda: tied.load_weights({"lm_head.weight": torch.zeros(101, 48, dtype=torch.float64)}),
         "tied to model.embed_tokens.weight"),
        ("a run with LoRA adapters", lambda: lora.load_weights({"model.embed_tokens.weight": embed}), "LoRA adapters"),
        ("its own full weights", lambda: run.load_weights(run.full_weights(dtype=torch.float64)),
         "stepped or loaded while this iteration was under way"),
    ]
    ok = refusals_hold(cases)
    ok &= refused_while_offloaded(run, lambda: run.load_weights({"model.embed_tokens.weight": embed}), "loading")
    # Its own full weights: the first unit loaded (the same values) before the iteration refused.
    unchanged = same_weights(weights_of(run), before)
    ok &= unchanged
    print(f"{'ok  ' if unchanged else 'FAIL'} the refused calls left the weights {'as they were' if unchanged else 'CHANGED'}")
    return ok


def main():
    if sys.argv[1] == "--rank":  # one of torchrun's processes
        world_rank(sys.argv[2], sys.argv[3])
        return 0
    fixtures, work = sys.argv[1], sys.argv[2]
    run_file = write_run_file(fresh_dir(work), os.path.join(fixtures, "llama_untied"))
    ok = refresh_and_mix(run_file)
    ok &= loaded_run_steps_alike(run_file, fixtures, work)
    ok &= at_world_2(run_file, work)
    ok &= refusals(run_file, fixtures, work)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
