"""run.model.generate against transformers' generate, over a cache of keys and values.

Left-padded prompts of the fixtures transformers saved (Llama, Qwen3 with q/k norms, Mistral
with a 5-token sliding window, DeepSeek-V3 with latent attention and experts, Qwen3-MoE), in
float64:
- greedy: the same tokens as transformers' generate given the same prompts, mask, eos and
  pad, rows that end early included, and with nothing given (both read the model's
  generation_config.json); a vision-language model that draws its placeholders embeds them as
  text; and so for Qwen2-VL and Qwen2.5-VL prompts holding
  images and a video;
- sampled at a temperature with top-k and top-p: the same tokens as transformers' sampling
  from the same torch.manual_seed (both draw one multinomial a step from the same
  probabilities, to rounding);
- at world 2, ranks whose prompts, max_new_tokens and ends differ (one rank's rows all ending
  at once, which then steps on adding nothing): no hang, and each rank's rows as world 1
  generates them;
- generating leaves the run as it was: logits after it equal those before, and a DeepSeek-V3
  whose routing biases move with each step trains to bitwise the same weights with a
  generation between its steps as without;
- bad arguments (a right-padded mask, a temperature, top_p, eos outside the vocabulary, no new
  token, images to a text model), a generation_config.json whose eos is no token, or out of
  the vocabulary, or whose temperature is negative (each named with its file),
  a sequence-classification model, weights whose logits overflow, and an offloaded run each raise fsdpp.Error;
- where a GPU is present, a float32 run on it generates greedily what transformers generates
  on it (scripts/gpu_check.sh python runs this check there).

usage: check_generate.py FIXTURE_DIR WORK_DIR
"""
import json
import os
import shutil
import sys

import torch

from check_python_run import fresh_dir, refusals_hold, refused_while_offloaded, world_2_results, write_run_file

NEW_TOKENS = 12
MODELS = ("llama_untied", "qwen3", "mistral", "deepseek_v3", "qwen3_moe")


def prompts(seed, rows=3, tokens=7):
    """Prompts [rows, tokens] padded on the left with 0 (rows 0 and 2), and their mask."""
    ids = torch.randint(3, 100, (rows, tokens), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    mask[rows - 1, :1] = 0
    return ids * mask, mask


def reference_model(model_dir):
    from transformers import AutoModelForCausalLM
    moe = "moe" in model_dir or "deepseek" in model_dir
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64,
                                                **({"experts_implementation": "eager"} if moe else {}))


def reference_generate(model, ids, mask, **options):
    # Qwen3-MoE's router logits feed its load-balancing loss, which generate has no use for.
    extra = {"output_router_logits": False} if "Moe" in type(model).__name__ else {}
    return model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, **options, **extra)


def same_as_transformers(fixtures, work):
    import fsdpp
    ok = True
    for name in MODELS:
        model_dir = os.path.join(fixtures, name)
        run = fsdpp.Run(write_run_file(fresh_dir(os.path.join(work, name)), model_dir))
        reference = reference_model(model_dir)
        ids, mask = prompts(1)
        # eos 1 ends some rows early in these fixtures, whose generation config names it.
        eos = reference.generation_config.eos_token_id or 1
        greedy = run.model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, temperature=0,
                                    eos_token_id=eos, pad_token_id=0)
        want_greedy = reference_generate(reference, ids, mask, eos_token_id=eos, pad_token_id=0, do_sample=False)
        # Nothing given: both take the model's generation_config.json.
        defaults = run.model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS)
        want_defaults = reference_generate(reference, ids, mask)
        sampling = {"temperature": 0.8, "top_k": 40, "top_p": 0.9}
        torch.manual_seed(11)
        sampled = run.model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, eos_token_id=eos,
                                     pad_token_id=0, **sampling)
        torch.manual_seed(11)
        want_sampled = reference_generate(reference, ids, mask, eos_token_id=eos, pad_token_id=0, do_sample=True,
                                          **sampling)
        ended = int((greedy[:, ids.shape[1]:] == 0).any(1).sum())
        same = torch.equal(greedy, want_greedy) and torch.equal(sampled, want_sampled) and \
            torch.equal(defaults, want_defaults)
        ok &= same
        print(f"{'ok  ' if same else 'FAIL'} {name}: {NEW_TOKENS} tokens after left-padded prompts, greedy "
              f"({ended} of 3 rows ended early), sampled at temperature 0.8, top-k 40, top-p 0.9, and with "
              "generation_config.json's defaults: "
              f"{'the same tokens as' if same else 'NOT'} transformers' generate")
        if not same:
            print(f"     greedy {greedy.tolist()} against {want_greedy.tolist()}\n"
                  f"     sampled {sampled.tolist()} against {want_sampled.tolist()}\n"
                  f"     defaults {defaults.tolist()} against {want_defaults.tolist()}")
    return ok


def images_as_transformers(fixtures, work):
    """Qwen2-VL and Qwen2.5-VL continue left-padded prompts holding an image, and an image and
    a video, greedily: the tokens transformers' generate gives the same pixels, grids, token
    types and mask (the text after the images placed past their rows and columns)."""
    import fsdpp
    from check_vision_inputs import reference_model as vision_reference
    from check_vision_inputs import rows, token_types
    ok = True
    for name in ("qwen2_vl", "qwen2_5_vl"):
        model_dir = os.path.join(fixtures, name)
        run = fsdpp.Run(write_run_file(fresh_dir(os.path.join(work, name)), model_dir))
        ids, mask, vision = rows(name == "qwen2_5_vl")
        # Row 0 as it is (padded on the left); row 1's tokens up to its video's end, padded on the left.
        second = torch.cat([torch.zeros(18, dtype=torch.long), ids[1, :22]])
        prompt = torch.stack([ids[0], second])
        prompt_mask = torch.stack([mask[0], (second != 0).long()])
        given = {"attention_mask": prompt_mask, "mm_token_type_ids": token_types(prompt), **vision}
        got = run.model.generate(prompt, max_new_tokens=NEW_TOKENS, temperature=0, eos_token_id=1, pad_token_id=0,
                                 **given)
        want = vision_reference(model_dir).generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=1,
                                                    pad_token_id=0, **given)
        same = torch.equal(got, want)
        ok &= same
        print(f"{'ok  ' if same else 'FAIL'} {name}: {NEW_TOKENS} tokens after left-padded prompts with an image, and "
              f"an image and a video: {'the same tokens as' if same else 'NOT'} transformers' generate")
        if not same:
            print(f"     {got[:, 40:].tolist()} against {want[:, 40:].tolist()}")
    return ok and drawn_placeholders_are_text(fixtures, work)


def drawn_placeholders_are_text(fixtures, work):
    """A Qwen2-VL whose head can only draw its image or video placeholder (the final norm keeps
    one feature, which the head maps to +image, -video) continues a text prompt: each drawn
    placeholder is embedded as text, as transformers does when decoding, not refused for
    lacking its image."""
    import fsdpp
    run = fsdpp.Run(write_run_file(fresh_dir(os.path.join(work, "placeholders")), os.path.join(fixtures, "qwen2_vl")),
                    frozen=True)
    norm = torch.zeros(48, dtype=torch.float64)
    norm[0] = 1.0
    head = torch.zeros(300, 48, dtype=torch.float64)
    head[290, 0], head[291, 0] = 100.0, -100.0
    run.load_weights({"model.norm.weight": norm, "lm_head.weight": head})
    ids, _ = prompts(12, rows=2)
    try:
        drawn = run.model.generate(ids, max_new_tokens=6, temperature=0)[:, ids.shape[1]:]
        ok, said = bool(((drawn == 290) | (drawn == 291)).all()), drawn.tolist()
    except fsdpp.Error as e:
        ok, said = False, str(e)
    print(f"{'ok  ' if ok else 'FAIL'} qwen2_vl drawing only placeholders goes on, each embedded as text: {said}")
    return ok


def rank_generation(rank):
    """What rank `rank` of world 2 generates: its own prompts, max_new_tokens and eos. Every
    token ends rank 0's rows, which add one token each; rank 1 asks for more, and its rows end
    at other steps."""
    ids, mask = prompts(20 + rank, rows=2 + rank, tokens=5 + 2 * rank)
    return ids, mask, 4 + 6 * rank, list(range(101)) if rank == 0 else [1, 2]


def world_rank(run_file, out):
    import fsdpp
    run = fsdpp.Run(run_file)
    ids, mask, new, eos = rank_generation(run.rank)
    got = run.model.generate(ids, attention_mask=mask, max_new_tokens=new, temperature=0, eos_token_id=eos,
                             pad_token_id=0)
    torch.save(got, f"{out}.{run.rank}.pt")


def matches_world_1(fixtures, work):
    import fsdpp
    run_file = write_run_file(fresh_dir(os.path.join(work, "world")), os.path.join(fixtures, "llama_untied"))
    run = fsdpp.Run(run_file)
    want = []
    for rank in range(2):
        ids, mask, new, eos = rank_generation(rank)
        want.append(run.model.generate(ids, attention_mask=mask, max_new_tokens=new, temperature=0,
                                       eos_token_id=eos, pad_token_id=0))
    got = world_2_results(__file__, os.path.join(work, "world", "generated"), run_file)
    if got is None:
        return False
    same = all(torch.equal(g, w) for g, w in zip(got, want))
    print(f"{'ok  ' if same else 'FAIL'} world 2, ranks asking for 4 and 10 tokens from prompts of 5 and 7, rank 0's "
          f"rows ending after one: each rank's rows ({[tuple(g.shape) for g in got]}) {'as' if same else 'NOT as'} "
          "world 1 generates them")
    return same


def train_deepseek(run_file, generate_between):
    """Full weights after 2 steps of a DeepSeek-V3 whose routing biases move each step, with or
    without a generation before each step."""
    import fsdpp
    run = fsdpp.Run(run_file, {"experts.bias_update_rate": 1e-3})
    ids = torch.randint(100, (2, 9), generator=torch.Generator().manual_seed(4))
    for _ in range(2):
        if generate_between:
            run.model.generate(*prompts(5), temperature=0, max_new_tokens=4)
        logits = run.model(ids[:, :-1])
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten()).backward()
        run.step()
        run.zero_grad()
    return {name: t.clone() for name, t in run.full_weights(dtype=torch.float64)}


def leaves_the_run_as_it_was(fixtures, work):
    import fsdpp
    run = fsdpp.Run(write_run_file(fresh_dir(os.path.join(work, "as-it-was")), os.path.join(fixtures, "qwen3")))
    ids, _ = prompts(3)
    with torch.no_grad():
        before = run.model(ids)
        run.model.generate(*prompts(6), max_new_tokens=5)
        after = run.model(ids)
    run_file = write_run_file(fresh_dir(os.path.join(work, "deepseek")), os.path.join(fixtures, "deepseek_v3"))
    plain, generating = train_deepseek(run_file, False), train_deepseek(run_file, True)
    same = torch.equal(before, after) and set(plain) == set(generating) and \
        all(torch.equal(plain[k], generating[k]) for k in plain)
    print(f"{'ok  ' if same else 'FAIL'} a generation leaves the run as it was: the logits after it "
          f"{'equal' if torch.equal(before, after) else 'DIFFER from'} those before, and a DeepSeek-V3 trained with "
          "generations between its steps ends with bitwise the weights it has without")
    return same


def refusals(fixtures, work):
    import fsdpp
    run = fsdpp.Run(write_run_file(fresh_dir(os.path.join(work, "bad")), os.path.join(fixtures, "llama_untied")))
    ids, mask = prompts(2)
    right = mask.flip(1)
    from check_critic import make_classifier
    classifier_dir = make_classifier(os.path.join(fixtures, "llama_untied"), fresh_dir(os.path.join(work, "classifier")))
    classifier = fsdpp.Run(write_run_file(fresh_dir(os.path.join(work, "scores")), classifier_dir))
    # Models whose generation_config.json holds a value that is not one, or is out of range
    # (do_sample null says nothing, as transformers reads it): generate names the file and key.
    def odd_config(name, values):
        model_dir = fresh_dir(os.path.join(work, f"{name}-config"))
        for file in ("config.json", "model.safetensors"):
            shutil.copy(os.path.join(fixtures, "llama_untied", file), model_dir)
        with open(os.path.join(model_dir, "generation_config.json"), "w") as f:
            json.dump(values, f)
        run = fsdpp.Run(write_run_file(fresh_dir(os.path.join(work, name)), model_dir), frozen=True)
        return run, os.path.join(model_dir, "generation_config.json")

    odd, odd_file = odd_config("odd", {"eos_token_id": "end"})
    far, far_file = odd_config("far", {"eos_token_id": 500, "do_sample": None})
    cold, cold_file = odd_config("cold", {"do_sample": True, "temperature": -2})
    diverged = fsdpp.Run(write_run_file(fresh_dir(os.path.join(work, "diverged")), os.path.join(fixtures, "llama_untied")),
                         frozen=True)
    # Finite weights whose logits overflow, as those of a run that diverged do (load_weights
    # refuses weights of NaN or inf themselves).
    diverged.load_weights({"model.norm.weight": torch.full((48,), 1e300, dtype=torch.float64),
                           "lm_head.weight": torch.full((101, 48), 1e300, dtype=torch.float64)})
    cases = [
        ("a mask padded on the right", lambda: run.model.generate(ids, attention_mask=right),
         "attention_mask: row 0 is not padded on the left alone"),
        ("a negative temperature", lambda: run.model.generate(ids, temperature=-1.0), "temperature: must be 0"),
        ("top_p 0", lambda: run.model.generate(ids, top_p=0.0), "top_p: must be in (0, 1]"),
        ("an eos outside the vocabulary", lambda: run.model.generate(ids, eos_token_id=[2, 500]),
         "eos_token_id: must be a token in [0, 101), got 500"),
        ("no new token", lambda: run.model.generate(ids, max_new_tokens=0), "max_new_tokens: must be in [1, 1000000]"),
        ("a sequence-classification model", lambda: classifier.model.generate(ids),
         "generate: LlamaForSequenceClassification scores tokens with its score head, and predicts none"),
        ("a generation_config.json whose eos is no token", lambda: odd.model.generate(ids),
         f"{odd_file}: eos_token_id: must be an int or a list of ints, got 'end'"),
        ("a generation_config.json whose eos is outside the vocabulary", lambda: far.model.generate(ids),
         f"{far_file}: eos_token_id: must be a token in [0, 101), got 500"),
        ("a generation_config.json whose temperature is negative", lambda: cold.model.generate(ids),
         f"{cold_file}: temperature: must be 0"),
        ("weights whose logits overflow", lambda: diverged.model.generate(ids, temperature=1.0),
         "generate: the logits hold NaN or inf at new token 1 on 1 rank(s) of 1"),
        ("images given to a text model", lambda: run.model.generate(ids, pixel_values=torch.zeros(4, 96),
                                                                    image_grid_thw=torch.tensor([[1, 2, 2]])),
         "llama takes no images or videos"),
    ]
    ok = refusals_hold(cases)
    return refused_while_offloaded(run, lambda: run.model.generate(ids), "generating") and ok


def on_the_gpu(fixtures, work):
    """Greedy tokens of a float32 run on the GPU against transformers' on the GPU."""
    import fsdpp
    model_dir = os.path.join(fixtures, "llama_untied")
    run = fsdpp.Run(write_run_file(fresh_dir(os.path.join(work, "gpu")), model_dir, dtype="float32"),
                    {"parallel.device": "cuda"})
    reference = reference_model(model_dir).float().cuda()
    ids, mask = prompts(8)
    got = run.model.generate(ids.cuda(), attention_mask=mask.cuda(), max_new_tokens=NEW_TOKENS, temperature=0,
                             eos_token_id=2, pad_token_id=0)
    want = reference_generate(reference, ids.cuda(), mask.cuda(), eos_token_id=2, pad_token_id=0, do_sample=False)
    same = got.is_cuda and torch.equal(got, want)
    print(f"{'ok  ' if same else 'FAIL'} on {torch.cuda.get_device_name()}: float32 greedy tokens "
          f"{'equal' if same else 'DIFFER from'} transformers' on the same GPU")
    return same


def main():
    if sys.argv[1] == "--rank":  # one of torchrun's processes
        world_rank(sys.argv[2], sys.argv[3])
        return 0
    fixtures, work = sys.argv[1], sys.argv[2]
    ok = same_as_transformers(fixtures, work)
    ok &= images_as_transformers(fixtures, work)
    ok &= matches_world_1(fixtures, work)
    ok &= leaves_the_run_as_it_was(fixtures, work)
    ok &= refusals(fixtures, work)
    if torch.cuda.is_available():
        ok &= on_the_gpu(fixtures, work)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
