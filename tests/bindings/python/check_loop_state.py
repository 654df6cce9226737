"""A Python loop's own state travels with the run's checkpoint, per rank.

Over the llama_untied fixture (made by transformers), in float64:
- at world 2 under torchrun, after one step each rank saves its own loop state (rank 1 none
  where asked): a Run resumed from that checkpoint at world 2 gives each rank back its own; at
  world 3 rank r gets rank r % 2's; run.load at world 1 returns rank 0's; a rank that saved
  none gets None;
- a loop state that is not JSON (a NaN) on one rank raises fsdpp.Error on every rank
  and saves nothing; a fresh Run's loop state is None.

usage: check_loop_state.py FIXTURE_DIR WORK_DIR
"""
import json
import os
import sys

from check_python_run import ROWS, batches, fresh_dir, run_ranks, write_run_file


def state_of(rank):
    return {"rank": rank, "prompt": 17 + rank, "kl": 0.05, "seeds": [2**63 - 1, -3], "notes": ["é", None, True]}


def rank_main(run_file, work, phase):
    import fsdpp
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    seen = {}
    if phase == "save":
        run = fsdpp.Run(run_file)
        seen["fresh"] = run.loop_state
        ids = batches(101)[0][0][rank * ROWS // world:(rank + 1) * ROWS // world]
        run.model(ids).logsumexp(-1).mean().backward()
        run.step()
        try:
            run.save(os.path.join(work, "refused"), loop_state=float("nan") if rank == 1 else state_of(rank))
            seen["nan"] = "no error"
        except fsdpp.Error as e:
            seen["nan"] = str(e)
        seen["refused_saved_nothing"] = not os.path.exists(os.path.join(work, "refused", "step-00000001"))
        seen["path"] = run.save(os.path.join(work, "saves"), loop_state=state_of(rank))
        seen["path_none"] = run.save(os.path.join(work, "saves-none"), loop_state=None if rank == 1 else state_of(rank))
    else:
        seen["resumed"] = fsdpp.Run(run_file, {"checkpoint.resume": os.path.join(work, "saves", "step-00000001")},
                                    ).loop_state
        seen["resumed_none"] = fsdpp.Run(
            run_file, {"checkpoint.resume": os.path.join(work, "saves-none", "step-00000001")}).loop_state
    json.dump(seen, open(os.path.join(work, f"{phase}.{world}.{rank}"), "w"))


def torchrun(work, run_file, world, phase):
    done = run_ranks(__file__, world, run_file, work, phase)
    if done.returncode != 0:
        print(done.stdout + done.stderr)
    return done.returncode == 0


def main():
    if sys.argv[1] == "--rank":
        rank_main(*sys.argv[2:5])
        return 0
    import fsdpp
    fixtures, work = sys.argv[1], sys.argv[2]
    fresh_dir(work)
    run_file = write_run_file(work, os.path.join(fixtures, "llama_untied"))
    ran = torchrun(work, run_file, 2, "save") and torchrun(work, run_file, 2, "resume") and \
        torchrun(work, run_file, 3, "resume")
    if not ran:
        print("FAIL the ranks ended with an error")
        return 1
    saved = [json.load(open(os.path.join(work, f"save.2.{r}"))) for r in range(2)]
    at2 = [json.load(open(os.path.join(work, f"resume.2.{r}"))) for r in range(2)]
    at3 = [json.load(open(os.path.join(work, f"resume.3.{r}"))) for r in range(3)]
    run = fsdpp.Run(run_file, {"train.out_dir": os.path.join(work, "world1")})
    loaded = run.load(saved[0]["path"])
    expected = [json.loads(json.dumps(state_of(r))) for r in range(2)]
    checks = [
        ("a fresh Run has no loop state", all(s["fresh"] is None for s in saved)),
        ("a NaN on rank 1 raises on every rank and saves nothing",
         saved[1]["nan"].startswith("save: loop_state must be a JSON value") and
         saved[0]["nan"] == "save: rank 1's inputs were refused (its error says why); every rank raises, and the run "
                            "goes on" and all(s["refused_saved_nothing"] for s in saved)),
        ("resumed at world 2, each rank gets its own back", at2 == [{"resumed": expected[0],
                                                                  "resumed_none": expected[0]},
                                                                 {"resumed": expected[1], "resumed_none": None}]),
        ("resumed at world 3, rank r gets rank r % 2's", [s["resumed"] for s in at3] == [expected[0], expected[1],
                                                                                          expected[0]]),
        ("load at world 1 returns rank 0's, and loop_state keeps it",
         loaded == expected[0] and run.loop_state == expected[0] and run.steps == 1),
    ]
    for name, ok in checks:
        print(f"{'ok  ' if ok else 'FAIL'} {name}")
    return 0 if all(ok for _, ok in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
