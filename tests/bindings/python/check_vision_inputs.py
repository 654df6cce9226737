"""Images and videos through run.model, logprobs and hidden_states, against transformers.

Qwen2-VL and Qwen2.5-VL made by transformers (the test fixtures) take rows that hold an image,
an image and a video, and text alone, padded on the left and on the right as an RL loop's
batches come, with the pixels, grids and token types a processor gives:
- at every token the mask keeps, logits, final hidden states and log-probabilities equal
  transformers' given the same inputs and attention_mask (1e-6 relative: transformers
  computes its rotary tables in float32), and rows packed into one as documents give each
  row's logits;
- a loop's clipped-ratio loss on logprobs trains Qwen2.5-VL as transformers + AdamW does
  over 3 steps (the first step's loss and gradient norm within 1e-6, later ones within 1e-3),
  and so with its vision tower frozen ([policy.options] freeze = "visual"; transformers' tower
  with requires_grad False), the tower then bitwise as loaded, also across a save and resume,
  and a resume that would train the tower from that checkpoint refused (it holds no moments);
- at world 2, one rank's rows holding the images and the other's text alone (its tower runs a
  blank frame, or the ranks' collectives would part), the losses, gradient norms and every
  weight equal world 1's over the same rows within 1e-10 in float64; rank 1's bad grid alone
  raises on both ranks, and the run goes on;
- a grid that disagrees with the placeholders, patches of the wrong width or count, position_ids,
  token types that disagree, an unknown keyword, and images given to a text model each raise
  fsdpp.Error naming the argument.

usage: check_vision_inputs.py FIXTURE_DIR WORK_DIR
"""
import math
import os
import sys

import torch

from check_python_run import (FIRST_STEP_BOUND, FLOAT64_BOUND, LATER_STEPS_BOUND, backward_and_step, fresh_dir,
                              refusal, refusals_hold, reference_step, relative_gap, world_2_results,
                              write_run_file)

IMAGE, VIDEO, START, END = 290, 291, 292, 293  # the fixtures' placeholder and delimiter tokens
PATCH_WIDTH = 3 * 2 * 4 * 4  # channels x frames per patch x patch side^2
STEPS = 3


def rows(with_seconds):
    """Four rows of 40 tokens, their attention mask and what a processor would give beside them:
    row 0 left-padded with a 4 x 6 image, row 1 a 2 x 2 image then a 2-frame 4 x 4 video and
    right padding, rows 2 and 3 text alone (3 right-padded). Rows 0-1 hold every image."""
    g = torch.Generator().manual_seed(3)

    def text(n):
        return torch.randint(1, IMAGE, (n,), generator=g).tolist()

    def block(token, t, h, w):
        return [START] + [token] * (t * h * w // 4) + [END]

    ids = [[0] * 5 + text(4) + block(IMAGE, 1, 4, 6) + text(23),
           text(3) + block(IMAGE, 1, 2, 2) + text(2) + block(VIDEO, 2, 4, 4) + text(4) + [0] * 18,
           text(40),
           text(31) + [0] * 9]
    ids = torch.tensor(ids)
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    mask[1, 22:] = 0
    mask[3, 31:] = 0
    vision = {"pixel_values": torch.randn(24 + 4, PATCH_WIDTH, generator=g, dtype=torch.float64).float(),
              "image_grid_thw": torch.tensor([[1, 4, 6], [1, 2, 2]]),
              "pixel_values_videos": torch.randn(32, PATCH_WIDTH, generator=g, dtype=torch.float64).float(),
              "video_grid_thw": torch.tensor([[2, 4, 4]])}
    if with_seconds:
        vision["second_per_grid_ts"] = torch.tensor([2.0])
    return ids, mask, vision


def token_types(ids):
    return (ids == IMAGE).long() + 2 * (ids == VIDEO).long()


def reference_model(model_dir):
    import transformers
    name = "Qwen2_5_VLForConditionalGeneration" if "2_5" in model_dir else "Qwen2VLForConditionalGeneration"
    return getattr(transformers, name).from_pretrained(model_dir, dtype=torch.float64)


def gap_at(got, want, keep):
    kept = keep.bool()
    return ((got[kept] - want[kept]).norm() / want[kept].norm()).item()


def packed_documents(run, model_dir):
    """Rows 0 and 1's tokens packed into one row as two documents, their images in order: each
    document's logits are those of its row alone (within 1e-10 in float64)."""
    ids, mask, vision = rows("2_5" in model_dir)
    with torch.no_grad():
        alone = run.model(ids[:2], attention_mask=mask[:2], **vision)  # [2, 40, V]
        kept = [ids[r][mask[r].bool()] for r in range(2)]
        packed = torch.cat(kept)[None]  # [1, 35 + 22]
        offsets = torch.tensor([0, len(kept[0]), packed.shape[1]])
        logits = run.model(packed, document_offsets=offsets, **vision)[0]  # [57, V]
    want = torch.cat([alone[r][mask[r].bool()] for r in range(2)])
    gap = ((logits - want).norm() / want.norm()).item()
    ok = gap <= FLOAT64_BOUND
    print(f"{'ok  ' if ok else 'FAIL'} {os.path.basename(model_dir)}: two rows with images packed into one as "
          f"documents give each row's logits: {gap:.1e} (bound {FLOAT64_BOUND:.0e}, relative)")
    return ok


def shifted(ids, mask, vision):
    """A forward's inputs, targets and kept targets for log-probabilities: each row's tokens
    but the last predict the next; a target counts where it and the token before it are kept."""
    inputs = {"attention_mask": mask[:, :-1], "mm_token_type_ids": token_types(ids[:, :-1]), **vision}
    return ids[:, :-1], ids[:, 1:], inputs, mask[:, :-1] * mask[:, 1:]


def policy_loss(logp, keep, step):
    """PPO's clipped objective over the kept targets [B, T]: old log-probabilities near a
    uniform model's over the 300 tokens, and advantages, drawn per step."""
    g = torch.Generator().manual_seed(100 + step)
    advantages = torch.randn(logp.shape, generator=g, dtype=torch.float64)
    old = -math.log(300) + 0.1 * torch.randn(logp.shape, generator=g, dtype=torch.float64)
    ratio = torch.exp(logp - old)
    return -(torch.min(ratio * advantages, ratio.clamp(0.8, 1.2) * advantages) * keep).sum() / keep.sum()


def forwards_match(run, model_dir):
    ids, mask, vision = rows("2_5" in model_dir)
    reference = reference_model(model_dir)
    with torch.no_grad():
        out = reference(input_ids=ids, attention_mask=mask, mm_token_type_ids=token_types(ids), use_cache=False,
                        output_hidden_states=True, **vision)
        inputs, targets, shifted_inputs, keep = shifted(ids, mask, vision)
        want_logp = torch.log_softmax(out.logits[:, :-1], -1).gather(-1, targets[..., None]).squeeze(-1)
        given = {"attention_mask": mask, "mm_token_type_ids": token_types(ids), **vision}
        gaps = {"logits": gap_at(run.model(ids, **given), out.logits, mask),
                "hidden states": gap_at(run.model.hidden_states(ids, **given), out.hidden_states[-1], mask),
                "log-probabilities": gap_at(run.model.logprobs(inputs, targets, **shifted_inputs), want_logp, keep)}
    ok = max(gaps.values()) <= FIRST_STEP_BOUND
    print(f"{'ok  ' if ok else 'FAIL'} {os.path.basename(model_dir)}: padded rows with images and a video against "
          "transformers: " + ", ".join(f"{k} {v:.1e}" for k, v in gaps.items()) +
          f" (bound {FIRST_STEP_BOUND:.0e}, relative)")
    return ok


def train_fsdpp(run, ids, mask, vision, rows_of_rank, steps=range(STEPS)):
    """(losses, norms) of `steps` of the clipped-ratio loss on the rows `rows_of_rank` picks, and
    the full weights after them. At world 1 the two halves' losses are averaged, as two ranks'
    gradients are."""
    losses, norms = [], []
    for step in steps:
        loss = 0
        for half in rows_of_rank:
            inputs, targets, given, keep = shifted(ids[half], mask[half], vision if half.start == 0 else {})
            loss = loss + policy_loss(run.model.logprobs(inputs, targets, **given), keep, step) / len(rows_of_rank)
        backward_and_step(run, loss, losses, norms)
    return (losses, norms), {name: t.clone() for name, t in run.full_weights(dtype=torch.float64)}


HALVES = [slice(0, 2), slice(2, 4)]


def train_reference(model_dir, ids, mask, vision, frozen_tower):
    model = reference_model(model_dir)
    if frozen_tower:
        for name, p in model.named_parameters():
            p.requires_grad_("visual" not in name)
    trained = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in trained if p.ndim >= 2]
    no_decay = [p for p in trained if p.ndim < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                                  lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    losses, norms = [], []
    for step in range(STEPS):
        loss = 0
        for half in HALVES:
            given = vision if half.start == 0 else {}
            logits = model(input_ids=ids[half], attention_mask=mask[half], mm_token_type_ids=token_types(ids[half]),
                           use_cache=False, **given).logits
            logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[half, 1:, None]).squeeze(-1)
            loss = loss + policy_loss(logp, mask[half, :-1] * mask[half, 1:], step) / 2
        reference_step(model, optimizer, loss, losses, norms)
    return losses, norms


def trains_as_transformers(run_file, model_dir, frozen_tower=False):
    """STEPS steps against transformers + AdamW; with `frozen_tower` ([policy.options] freeze =
    "visual", as the reference's tower has requires_grad False) the tower's weights must stay
    the fixture's bitwise, and a run saved after 2 steps and resumed must end where this one does."""
    import fsdpp
    from safetensors.torch import load_file
    overrides = {"policy.options.fused_linear_logprob": True,
                 **({"policy.options.freeze": "visual"} if frozen_tower else {})}
    run = fsdpp.Run(run_file, overrides)
    ids, mask, vision = rows(True)
    (losses, norms), weights = train_fsdpp(run, ids, mask, vision, HALVES)
    want_losses, want_norms = train_reference(model_dir, ids, mask, vision, frozen_tower)
    first = max(relative_gap(losses[0], want_losses[0]), relative_gap(norms[0], want_norms[0]))
    later = max(relative_gap(a, b) for a, b in zip(losses[1:] + norms[1:], want_losses[1:] + want_norms[1:]))
    ok = first <= FIRST_STEP_BOUND and later <= LATER_STEPS_BOUND
    what = "with the vision tower frozen" if frozen_tower else "with images"
    print(f"{'ok  ' if ok else 'FAIL'} {os.path.basename(model_dir)}: {STEPS} steps of a clipped-ratio loss on logprobs "
          f"{what}, losses {losses[0]:.6f} .. {losses[-1]:.6f}; against transformers + AdamW, first step {first:.1e} "
          f"(bound {FIRST_STEP_BOUND:.0e}), later losses and norms {later:.1e} (bound {LATER_STEPS_BOUND:.0e}), "
          "relative")
    if not frozen_tower:
        return ok
    initial = load_file(os.path.join(model_dir, "model.safetensors"))
    tower = [k for k in weights if "visual" in k]
    still = all(torch.equal(weights[k], initial[k].double()) for k in tower)
    rest_moved = max((weights[k] - initial[k].double()).abs().max().item() for k in weights if k not in tower)
    saving = fsdpp.Run(run_file, overrides)
    train_fsdpp(saving, ids, mask, vision, HALVES, range(2))
    saved = saving.save(os.path.join(os.path.dirname(run_file), "frozen-saves"))
    resumed = fsdpp.Run(run_file, {**overrides, "checkpoint.resume": saved})
    _, resumed_weights = train_fsdpp(resumed, ids, mask, vision, HALVES, range(2, STEPS))
    same = set(resumed_weights) == set(weights) and all(torch.equal(resumed_weights[k], weights[k]) for k in weights)
    # Resumed with the tower trained, the checkpoint holds no moments for it: refused, naming why.
    thawed = refusal(lambda: fsdpp.Run(run_file, {"policy.options.fused_linear_logprob": True,
                                                  "checkpoint.resume": saved}))
    refused = "holds no optimizer state for 'visual." in thawed and "frozen there" in thawed
    # So is a built run's load() of it, before any row is written: the run goes on as it was.
    built = fsdpp.Run(run_file, {"policy.options.fused_linear_logprob": True})
    before = dict(built.full_weights())
    into_built = refusal(lambda: built.load(saved))
    kept = set(dict(built.full_weights())) == set(before) and all(
        torch.equal(w, before[k]) for k, w in built.full_weights())
    refused &= "holds no optimizer state for 'visual." in into_built and kept
    print(f"{'ok  ' if still and rest_moved > 1e-3 else 'FAIL'} the frozen tower's {len(tower)} weights are the "
          f"fixture's bitwise after {STEPS} steps (the rest moved up to {rest_moved:.1e})")
    print(f"{'ok  ' if same else 'FAIL'} saved after 2 steps and resumed, the frozen run ends with "
          f"{'bitwise' if same else 'NOT'} the weights of the run that did not stop")
    print(f"{'ok  ' if refused else 'FAIL'} resumed with the tower trained: {thawed}; a built run's load(): "
          f"{into_built}, its weights {'as they were' if kept else 'CHANGED'}")
    return ok and still and rest_moved > 1e-3 and same and refused


def world_rank(run_file, out):
    """One rank of world 2: rank 0 takes the rows with the images, rank 1 the text rows. Before
    training, rank 1's bad grid alone must raise on both ranks."""
    import fsdpp
    run = fsdpp.Run(run_file, {"policy.options.fused_linear_logprob": True})
    ids, mask, vision = rows(False)
    mine = HALVES[run.rank]
    inputs, targets, given, _ = shifted(ids[mine], mask[mine], vision if run.rank == 0 else
                                        {"pixel_values": vision["pixel_values"][:4],
                                         "image_grid_thw": torch.tensor([[1, 2, 3]])})
    refused = refusal(lambda: run.model.logprobs(inputs, targets, **given))
    figures, weights = train_fsdpp(run, ids, mask, vision, [mine])
    torch.save((refused, figures, weights), f"{out}.{run.rank}.pt")


def matches_world_1(run_file, model_dir, work):
    import fsdpp
    from safetensors.torch import load_file
    run = fsdpp.Run(run_file, {"policy.options.fused_linear_logprob": True})
    ids, mask, vision = rows(False)
    (want_losses, want_norms), want_weights = train_fsdpp(run, ids, mask, vision, HALVES)
    initial = load_file(os.path.join(model_dir, "model.safetensors"))
    moved = max((want_weights[k] - initial[k].double()).abs().max().item() for k in want_weights)
    got = world_2_results(__file__, os.path.join(work, "world-2"), run_file)
    if got is None:
        return False
    said = [refused for refused, _, _ in got]
    both_refused = "image_grid_thw" in said[1] and "rank 1" in said[0]
    # Each rank's loss is its rows' mean; world 1's is the two halves' average.
    losses = [(a + b) / 2 for a, b in zip(got[0][1][0], got[1][1][0])]
    norms, weights = got[0][1][1], got[0][2]
    gap = max(abs(a - b) for a, b in zip(losses + norms, want_losses + want_norms))
    weight_gap = max((weights[k] - want_weights[k]).abs().max().item() for k in want_weights)
    ok = both_refused and set(weights) == set(want_weights) and max(gap, weight_gap) <= FLOAT64_BOUND and moved > 1e-3
    print(f"{'ok  ' if ok else 'FAIL'} world 2, images on rank 0 and text alone on rank 1: losses and norms {gap:.1e}, "
          f"{len(weights)} weights {weight_gap:.1e} from world 1's (bound {FLOAT64_BOUND:.0e}; training moved them up "
          f"to {moved:.1e}); rank 1's bad grid raised on rank 1: {said[1]!r}; on rank 0: {said[0]!r}")
    return ok


def refusals(run_file, text_run_file):
    import fsdpp
    run = fsdpp.Run(run_file)
    ids, mask, vision = rows(False)
    bad = {
        "image placeholders without grids": ({}, "past the 0 images the grids give"),
        "a grid that is not the placeholders'": ({**vision, "image_grid_thw": torch.tensor([[1, 4, 4], [1, 2, 2]]),
                                                   "pixel_values": vision["pixel_values"][:20]}, "holds a run of 6"),
        "patches of another width": ({**vision, "pixel_values": vision["pixel_values"][:, :90]}, "pixel_values"),
        "patches the grids do not count": ({**vision, "pixel_values": vision["pixel_values"][:27]}, "27 patches"),
        "a grid of half merge groups": ({**vision, "image_grid_thw": torch.tensor([[1, 4, 6], [1, 1, 4]])},
                                        "multiple of the merge size 2"),
        "token types that disagree": ({**vision, "mm_token_type_ids": torch.zeros_like(ids)}, "mm_token_type_ids"),
        "an unknown keyword": ({**vision, "pixel_value": vision["pixel_values"]}, "'pixel_value'"),
        "position_ids": ({**vision, "position_ids": torch.arange(40).expand(4, 40)}, "places its tokens itself"),
    }
    ok = refusals_hold([(name, lambda given=given: run.model(ids, attention_mask=mask, **given), wanted)
                        for name, (given, wanted) in bad.items()])
    text_run = fsdpp.Run(text_run_file)
    said = refusal(lambda: text_run.model(torch.zeros(1, 4, dtype=torch.long), pixel_values=vision["pixel_values"],
                                          image_grid_thw=vision["image_grid_thw"]))
    refused = "takes no images or videos" in said
    print(f"{'ok  ' if refused else 'FAIL'} images given to a text model: {said}")
    return ok and refused


def main():
    if sys.argv[1] == "--rank":  # one of torchrun's processes
        world_rank(sys.argv[2], sys.argv[3])
        return 0
    import fsdpp
    fixtures, work = sys.argv[1], sys.argv[2]
    ok = True
    for name in ("qwen2_vl", "qwen2_5_vl"):
        model_dir = os.path.join(fixtures, name)
        run_file = write_run_file(fresh_dir(os.path.join(work, name)), model_dir)
        run = fsdpp.Run(run_file, {"policy.options.fused_linear_logprob": True})
        ok &= forwards_match(run, model_dir) and packed_documents(run, model_dir)
        del run
        if name == "qwen2_5_vl":
            ok &= trains_as_transformers(run_file, model_dir)
            ok &= trains_as_transformers(run_file, model_dir, frozen_tower=True)
        else:
            ok &= matches_world_1(run_file, model_dir, os.path.join(work, name))
            ok &= refusals(run_file, write_run_file(fresh_dir(os.path.join(work, "text")),
                                                    os.path.join(fixtures, "llama_untied")))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
