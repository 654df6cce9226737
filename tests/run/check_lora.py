"""LoRA training against peft, across world sizes, and through a resume at another world size.
A small Llama made by transformers gets a fresh PEFT adapter (rank 3 on q_proj, v_proj and
down_proj; B zero, A as peft draws it). Then:
  - fsdpp trains it from that adapter ([model] adapter) in one process, and peft with AdamW on
    the same windows: every step's loss within 1e-5 relative (fp32);
  - in float64, world 2 and world 3 give the one-process adapter after 8 steps within
    compare.FLOAT64_BOUND, and the frozen base is exported nowhere; computing in float32
    (param_dtype), where the frozen base is held in float32 alone, within 1e-4;
  - a world-2 run saved at step 4 (a checkpoint of the adapters alone, with its base's
    identity) and resumed at world 3 ends with the uninterrupted run's adapter, every row (the
    failure where only one rank's slice of each adapter was saved would leave (N-1)/N of it
    at its step-4 values); onto a changed base the resume at world 2 is refused;
  - peft.PeftModel.from_pretrained loads the saved adapter and gives `fsdpp eval`'s logits,
    and `fsdpp export --merge-lora` gives a model transformers loads with the same logits, on
    an HF base and on a fresh one rebuilt from its recorded seed, and warns of nothing on
    loading either (no unknown or missing config key or weight); an adapter on the head of a
    model that ties it to its embedding is merged into an untied head;
  - `fsdpp export --adapter` of the last checkpoint writes the adapter the run wrote;
  - an adapter whose modules_to_save the policy's lora_trainable does not name, or whose file
    holds one factor of a module alone, is refused."""
import json
import os
import re
import shutil
import subprocess
import sys

import torch
import transformers
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file, save_file

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, os.path.join(HERE, "..", "..", "scripts"))
import cpu_cap  # noqa: E402
from bench_common import WindowSampler, lr_at, read_tokens  # noqa: E402
from compare import FLOAT64_BOUND, max_relative  # noqa: E402
from hf_load import load_quietly  # noqa: E402

cpu_cap.apply()  # before any torch kernel runs

FSDPP = os.environ["FSDPP"]
WORK = os.path.join(os.environ["WORK"], "lora")
CONFIG = "tests/assets/fsdp-llama.toml"
STEPS = 8
torch.set_num_threads(1)


def make_base_and_adapter():
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=48, intermediate_size=88, num_hidden_layers=2,
                                      num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(config)
    base.save_pretrained(os.path.join(WORK, "base"))
    model = get_peft_model(base, LoraConfig(r=3, lora_alpha=6, lora_dropout=0.0,
                                            target_modules=["q_proj", "v_proj", "down_proj"]))
    model.save_pretrained(os.path.join(WORK, "initial"))
    return model


def fsdpp(*args, world=1):
    cmd = [FSDPP, *args] if world == 1 else [FSDPP, "launch", "--nproc-per-node", str(world), "--", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        sys.exit(f"FAIL: {' '.join(cmd)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return proc


def train(name, world, sets):
    out = os.path.join(WORK, name)
    shutil.rmtree(out, ignore_errors=True)
    sets = [f'model.path="{WORK}/base"', f'model.adapter="{WORK}/initial"', f'train.out_dir="{out}"',
            f"train.steps={STEPS}", "data.shuffle=false", "train.clip_grad_norm=0"] + sets
    fsdpp("train", CONFIG, *[a for s in sets for a in ("--set", s)], world=world)
    losses = [json.loads(l)["loss"] for l in open(os.path.join(out, "metrics.jsonl")) if '"loss"' in l]
    return losses, out


def peft_losses(model):
    cfg = {"optimizer": {"lr": 1e-2, "weight_decay": 0.1, "beta2": 0.95, "eps": 1e-6},
           "scheduler": {"kind": "cosine", "warmup_steps": 3}, "train": {"steps": STEPS}}
    tokens, _ = read_tokens("data/licenses.tok")
    sampler = WindowSampler(tokens, 32)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW([{"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.1},
                             {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
                            lr=1e-2, betas=(0.9, 0.95), eps=1e-6)
    model.train()
    losses = []
    for step in range(1, STEPS + 1):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        opt.zero_grad()
        window = torch.from_numpy(sampler.take(12))
        logits = model(input_ids=window[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), window[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def adapter_difference(a, b):
    x, y = load_file(f"{a}/adapter/adapter_model.safetensors"), load_file(f"{b}/adapter/adapter_model.safetensors")
    if x.keys() != y.keys():
        return float("inf")
    return max(((x[k].double() - y[k].double()).abs().max() / y[k].double().abs().max()).item() for k in x)


def report(ok, text):
    print(f"{'ok  ' if ok else 'FAIL'} {text}")
    return ok


def main():
    subprocess.run(["bash", "scripts/make_corpus.sh"], check=True, capture_output=True)
    shutil.rmtree(WORK, ignore_errors=True)
    model = make_base_and_adapter()
    expected = peft_losses(model)
    one, _ = train("fp32-one", 1, [])
    gap = max_relative(one, expected)
    ok = report(gap <= 1e-5 and len(one) == STEPS,
                f"{STEPS} steps from peft's initial adapter: losses vs peft + AdamW {gap:.2e} (allowed 1e-5)")

    f64 = ['model.dtype="float64"']
    _, ref = train("one", 1, f64)
    for world in (2, 3):
        _, out = train(f"world{world}", world, f64)
        err = adapter_difference(out, ref)
        base_exported = os.path.exists(os.path.join(out, "model"))
        ok &= report(err <= FLOAT64_BOUND and not base_exported,
                     f"world {world}: adapter after {STEPS} steps vs one process {err:.2e} (allowed {FLOAT64_BOUND:g}); "
                     f"no full-model export: {not base_exported}")
        # Computing in float32, the frozen base is held in float32 alone (no float64 master):
        # the run follows the float64 one to float32's rounding.
        _, narrow = train(f"world{world}-fp32", world, f64 + ['policy.options.param_dtype="float32"'])
        err = adapter_difference(narrow, ref)
        ok &= report(err <= 1e-4, f"world {world} computing in float32 over a base held in float32: adapter vs the "
                     f"float64 one-process run's {err:.2e} (allowed 1e-4)")

    _, uninterrupted = train("saved", 2, f64 + ["checkpoint.save_every=4", "checkpoint.keep=0"])
    saved = f"{uninterrupted}/checkpoints/step-00000004"
    meta = json.load(open(f"{saved}/metadata.json"))
    held = sorted(k.removeprefix("model/") for k in meta["tensors"] if k.startswith("model/"))
    adapter_only = bool(held) and all(".lora_A." in k or ".lora_B." in k for k in held) and "base" in meta["model"]
    ok &= report(adapter_only, f"the checkpoint holds the adapters alone ({len(held)} tensors) and its base's identity "
                 f"({sorted(meta['model'].get('base', {}))})")
    _, resumed = train("resumed", 3, f64 + [f'checkpoint.resume="{saved}"'])
    err = adapter_difference(resumed, uninterrupted)
    ok &= report(err <= FLOAT64_BOUND, f"saved at world 2 step 4, resumed at world 3: final adapter vs the "
                 f"uninterrupted run's {err:.2e}, every row (allowed {FLOAT64_BOUND:g})")

    # Onto another base (the same shapes, one weight changed) the adapters are refused.
    other = os.path.join(WORK, "other-base")
    shutil.copytree(f"{WORK}/base", other)
    weights = load_file(f"{other}/model.safetensors")
    weights["model.norm.weight"] = weights["model.norm.weight"] + 1
    save_file(weights, f"{other}/model.safetensors", metadata={"format": "pt"})
    # Launched at world 2: one rank per node checks the base, and its refusal ends the run. The
    # data position is the saved run's (shuffle = false), so that the base is the one thing
    # refused: another refusal on the other rank would race it to the launcher's report.
    proc = subprocess.run([FSDPP, "launch", "--nproc-per-node", "2", "--", "train", CONFIG, "--set", f'model.path="{other}"', "--set",
                           f'train.out_dir="{WORK}/refused"', "--set", f'checkpoint.resume="{saved}"',
                           "--set", "data.shuffle=false"] +
                          [a for s in f64 for a in ("--set", s)], capture_output=True, text=True, timeout=600)
    errors = [l for l in proc.stderr.splitlines() if l.startswith("fsdpp: error:")]
    ok &= report(proc.returncode == 2 and len(errors) == 1 and "another base model" in errors[0],
                 f"resuming onto a changed base is refused: {errors}")
    # Onto a fresh base of the same config.json (no weights): the refusal says which is which.
    fresh_base = os.path.join(WORK, "fresh-base")
    shutil.rmtree(fresh_base, ignore_errors=True)
    os.makedirs(fresh_base)
    shutil.copy(f"{WORK}/base/config.json", fresh_base)
    proc = subprocess.run([FSDPP, "train", CONFIG, "--set", f'model.path="{fresh_base}"', "--set",
                           f'train.out_dir="{WORK}/refused-fresh"', "--set", f'checkpoint.resume="{saved}"',
                           "--set", "data.shuffle=false"] + [a for s in f64 for a in ("--set", s)],
                          capture_output=True, text=True, timeout=600)
    errors = [l for l in proc.stderr.splitlines() if l.startswith("fsdpp: error:")]
    ok &= report(proc.returncode == 2 and len(errors) == 1 and "model.safetensors" in errors[0] and
                 "a fresh model from its config.json (seed 11) now" in errors[0],
                 f"resuming onto a fresh base is refused, saying so: {errors}")

    # With adapters of another scale the checkpoint's are refused in one line that says what
    # each holds and which field differs, whatever the number of adapted modules.
    # So are adapters of another rank: said as adapters, before their rows meet the run's as
    # tensors of other shapes.
    for rank, alpha, differ in ((3, 0.5, "alpha"), (2, 6, "rank")):
        proc = subprocess.run([FSDPP, "train", CONFIG, "--set", f'model.path="{WORK}/base"', "--set",
                               f'train.out_dir="{WORK}/refused-{differ}"', "--set", f'checkpoint.resume="{saved}"',
                               "--set", f"policy.options.lora_rank={rank}", "--set", f"policy.options.lora_alpha={alpha}",
                               "--set", "data.shuffle=false"] +
                              [a for s in f64 for a in ("--set", s)], capture_output=True, text=True, timeout=600)
        errors = [l for l in proc.stderr.splitlines() if l.startswith("fsdpp: error:")]
        ok &= report(proc.returncode == 2 and len(errors) == 1 and
                     re.search(rf"holds LoRA adapters of rank \d+, alpha [\d.]+ on \d+ modules \([a-z_, ]+\), where this "
                               rf"run has LoRA adapters of rank {rank}, alpha {alpha:g}(\.0)? on \d+ modules \([a-z_, ]+\) "
                               rf"\(other [a-z, ]*{differ}[a-z, ]*\)$", errors[0]) is not None,
                     f"resuming with adapters of another {differ} is refused: {errors}")

    logits_file = os.path.join(WORK, "logits.safetensors")
    fsdpp("eval", CONFIG, "--set", f'model.path="{WORK}/base"', "--set", f'model.adapter="{ref}/adapter"',
          "--set", 'model.dtype="float64"', "--max-windows", "2", "--logits", logits_file)
    engine = load_file(logits_file)
    base = transformers.AutoModelForCausalLM.from_pretrained(f"{WORK}/base", dtype=torch.float64)
    loaded = PeftModel.from_pretrained(base, f"{ref}/adapter")
    with torch.no_grad():
        logits = loaded(engine["input_ids"]).logits
    err = ((logits - engine["logits"]).abs().max() / engine["logits"].abs().max()).item()
    # The logits file holds float32, as for check_export.py: 1e-5.
    ok &= report(err <= 1e-5, f"peft loads the saved adapter: its logits vs fsdpp eval's {err:.2e} (allowed 1e-5)")

    checkpoint_logits = os.path.join(WORK, "checkpoint-logits.safetensors")
    fsdpp("eval", CONFIG, "--set", f'model.path="{ref}/checkpoints/step-{STEPS:08d}"', "--set", 'model.dtype="float64"',
          "--max-windows", "2", "--logits", checkpoint_logits)
    err = ((load_file(checkpoint_logits)["logits"] - engine["logits"]).abs().max() / engine["logits"].abs().max()).item()
    ok &= report(err <= 1e-6, f"fsdpp eval of the run's checkpoint puts its adapters on: logits vs the base with the "
                 f"saved adapter {err:.2e} (allowed 1e-6)")
    proc = subprocess.run([FSDPP, "export", f"{ref}/checkpoints/step-{STEPS:08d}", os.path.join(WORK, "unmerged")],
                          capture_output=True, text=True, timeout=600)
    ok &= report(proc.returncode == 2 and "--merge-lora" in proc.stderr and len(proc.stderr.splitlines()) == 1,
                 f"a LoRA checkpoint exported without --merge-lora is refused: {proc.stderr.strip()}")
    # The adapters of a checkpoint, exported alone: the PEFT adapter the run wrote at that step.
    exported = os.path.join(WORK, "exported-adapter")
    shutil.rmtree(exported, ignore_errors=True)
    fsdpp("export", f"{ref}/checkpoints/step-{STEPS:08d}", exported, "--adapter")
    written, wanted = (load_file(f"{d}/adapter_model.safetensors") for d in (exported, f"{ref}/adapter"))
    same = written.keys() == wanted.keys() and all(torch.equal(written[k], wanted[k]) for k in wanted)
    configs = [json.load(open(f"{d}/adapter_config.json")) for d in (exported, f"{ref}/adapter")]
    keys = ("r", "lora_alpha", "target_modules", "modules_to_save")
    same &= all(configs[0][k] == configs[1][k] for k in keys)
    ok &= report(same, f"fsdpp export --adapter of step {STEPS}: the adapter the run wrote there, bitwise "
                 f"({len(written)} tensors)")
    merged = os.path.join(WORK, "merged")
    shutil.rmtree(merged, ignore_errors=True)
    fsdpp("export", f"{ref}/checkpoints/step-{STEPS:08d}", merged, "--merge-lora")
    model, warned = load_quietly(transformers.AutoModelForCausalLM, merged, dtype=torch.float64)
    with torch.no_grad():
        merged_logits = model(engine["input_ids"]).logits
    err = ((merged_logits - engine["logits"]).abs().max() / engine["logits"].abs().max()).item()
    ok &= report(err <= 1e-5 and not warned, f"fsdpp export --merge-lora loads in transformers, which warns of "
                 f"{warned or 'nothing'}: its logits vs fsdpp eval's with the adapter {err:.2e} (allowed 1e-5)")

    # On a fresh base (config.json alone) the checkpoint records the seed, from which export
    # rebuilds the frozen base it merges into.
    fresh = os.path.join(WORK, "fresh")
    shutil.rmtree(fresh, ignore_errors=True)
    fsdpp("train", CONFIG, "--set", 'model.dtype="float64"', "--set", "policy.options.lora_rank=3", "--set",
          "train.steps=2", "--set", f'train.out_dir="{fresh}"')
    _, warned, err = merged_against_eval(f"{fresh}/checkpoints/step-00000002", f"{fresh}/merged")
    ok &= report(err <= 1e-5 and not warned, f"on a fresh base, fsdpp export --merge-lora loads in transformers, "
                 f"which warns of {warned or 'nothing'}: its logits vs fsdpp eval's of the checkpoint {err:.2e} "
                 f"(allowed 1e-5)")
    # The frozen weights it wrote are the fresh base a full-model run starts from (one step at
    # lr 1e-12 moves them by ~1e-12): rebuilt from the recorded seed, in the run's dtype.
    fsdpp("train", CONFIG, "--set", 'model.dtype="float64"', "--set", "train.steps=1", "--set", "optimizer.lr=1e-12",
          "--set", f'train.out_dir="{fresh}/full"')
    fsdpp("export", f"{fresh}/full/checkpoints/step-00000001", f"{fresh}/full-export")
    merged, full = load_file(f"{fresh}/merged/model.safetensors"), load_file(f"{fresh}/full-export/model.safetensors")
    frozen = [k for k in merged if not k.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight"))]
    err = max(((merged[k] - full[k]).abs().max() / full[k].abs().max()).item() for k in frozen)
    ok &= report(len(frozen) > 0 and err <= 1e-9, f"its {len(frozen)} frozen tensors vs a full-model run's fresh "
                 f"initial weights {err:.2e} (allowed 1e-9)")
    ok &= check_adapter_disagreements(f"{ref}/checkpoints/step-{STEPS:08d}")
    ok &= check_tied_head()
    ok &= check_vision_language_adapter()
    ok &= check_moe_mlp_adapter_warning()
    sys.exit(0 if ok else 1)


def merged_against_eval(checkpoint, merged):
    """(transformers model, its loading warnings, max relative logit difference) of the
    float64 LoRA `checkpoint` exported merged into `merged`, against fsdpp eval's logits of
    the checkpoint itself."""
    logits_file = merged + ".logits.safetensors"
    fsdpp("eval", CONFIG, "--set", f'model.path="{checkpoint}"', "--set", 'model.dtype="float64"',
          "--max-windows", "2", "--logits", logits_file)
    engine = load_file(logits_file)
    fsdpp("export", checkpoint, merged, "--merge-lora")
    model, warned = load_quietly(transformers.AutoModelForCausalLM, merged, dtype=torch.float64)
    with torch.no_grad():
        merged_logits = model(engine["input_ids"]).logits
    return model, warned, ((merged_logits - engine["logits"]).abs().max() / engine["logits"].abs().max()).item()


def check_adapter_disagreements(checkpoint):
    """An adapter whose modules_to_save the policy's lora_trainable leaves out (or adds to) is
    refused, as one of another rank is, rather than its trained modules frozen at the base's
    values; so is an adapter file holding one factor of a module alone; a LoRA checkpoint
    whose adapters [model] adapter replaces says so; and fsdpp plan shows the adapter's LoRA."""
    policy = ["policy.options.lora_rank=3", "policy.options.lora_alpha=6",
              'policy.options.lora_targets="q_proj,v_proj,down_proj"']
    results = {}

    def attempt(name, sets):
        proc = subprocess.run([FSDPP, "eval", CONFIG, "--max-windows", "1", "--set", 'model.dtype="float64"',
                               *[a for s in sets for a in ("--set", s)]], capture_output=True, text=True, timeout=600)
        results[name] = (proc.returncode, [l for l in proc.stderr.splitlines() if "error" in l or "warning" in l])

    attempt("trainable", [f'model.path="{WORK}/base"', f'model.adapter="{WORK}/initial"',
                          'policy.options.lora_trainable="model.norm"'] + policy)
    lone = os.path.join(WORK, "lone-factor")
    shutil.rmtree(lone, ignore_errors=True)
    shutil.copytree(f"{WORK}/initial", lone)
    tensors = load_file(f"{lone}/adapter_model.safetensors")
    dropped = next(k for k in tensors if k.endswith("layers.0.self_attn.q_proj.lora_B.weight"))
    save_file({k: v for k, v in tensors.items() if k != dropped}, f"{lone}/adapter_model.safetensors")
    attempt("lone", [f'model.path="{WORK}/base"', f'model.adapter="{lone}"'])
    attempt("replaced", [f'model.path="{checkpoint}"', f'model.adapter="{WORK}/initial"'])
    # The plan shows what the adapter puts on, as the run does.
    planned = subprocess.run([FSDPP, "plan", CONFIG, "--set", f'model.path="{WORK}/base"', "--set",
                              f'model.adapter="{WORK}/initial"'], capture_output=True, text=True, timeout=600)
    lora_line = next((l for l in planned.stdout.splitlines() if l.startswith("lora: ")), planned.stderr.strip())
    results["plan"] = lora_line
    ok = (lora_line.startswith("lora: rank 3, alpha 6, dropout 0 on 6 modules") and
          results["trainable"][0] == 2 and "lora_trainable must name the same modules" in results["trainable"][1][-1]
          and results["lone"][0] == 2 and "has no lora_B beside it" in results["lone"][1][-1]
          and results["replaced"][0] == 0 and any("set aside for [model] adapter" in l for l in results["replaced"][1]))
    return report(ok, f"adapters that disagree: {results}")


def check_tied_head():
    """An adapter on lm_head of a model that ties it to its embedding: the merged export unties
    them, and transformers gives the adapted model's logits (the head's adapter kept, the
    embedding as it was)."""
    tied = os.path.join(WORK, "tied")
    shutil.rmtree(tied, ignore_errors=True)
    os.makedirs(os.path.join(tied, "base"))
    with open("tests/assets/models/fsdp-llama/config.json") as f:
        config = json.load(f)
    json.dump({**config, "tie_word_embeddings": True}, open(os.path.join(tied, "base", "config.json"), "w"))
    fsdpp("train", CONFIG, "--set", f'model.path="{tied}/base"', "--set", 'model.dtype="float64"', "--set",
          "policy.options.lora_rank=3", "--set", 'policy.options.lora_targets="q_proj,lm_head"', "--set",
          "train.steps=2", "--set", f'train.out_dir="{tied}/run"')
    checkpoint = f"{tied}/run/checkpoints/step-00000002"
    # A policy declaring other adapters than the checkpoint holds is refused, not obeyed.
    proc = subprocess.run([FSDPP, "eval", CONFIG, "--set", f'model.path="{checkpoint}"', "--set",
                           "policy.options.lora_rank=3", "--set", 'policy.options.lora_targets="q_proj"'],
                          capture_output=True, text=True, timeout=600)
    refused = proc.returncode == 2 and "the policy leaves out lm_head" in proc.stderr
    report(refused, f"eval of the checkpoint under a policy without its lm_head adapter: {proc.stderr.strip()[-300:]}")
    model, warned, err = merged_against_eval(checkpoint, f"{tied}/merged")
    untied = not model.config.tie_word_embeddings and not torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)
    return refused and report(untied and err <= 1e-5 and not warned,
                  f"a tied model's adapted lm_head: the merged export unties it ({untied}), loads in transformers, "
                  f"which warns of {warned or 'nothing'}, with fsdpp eval's logits {err:.2e} (allowed 1e-5)")


def check_vision_language_adapter():
    """Qwen2-VL's adapter on its language model and vision tower: transformers 5 keeps them under
    model.language_model and model.visual, and PEFT names adapters by those module paths. The
    run's adapter loads in peft with fsdpp eval's logits; one peft makes loads in fsdpp."""
    vl = os.path.join(WORK, "vl")
    shutil.rmtree(vl, ignore_errors=True)
    base = os.path.join(os.environ["FIXTURES"], "qwen2_vl")
    fsdpp("train", CONFIG, "--set", f'model.path="{base}"', "--set", 'model.dtype="float64"', "--set",
          "policy.options.lora_rank=3", "--set", 'policy.options.lora_targets="q_proj,v_proj,qkv"', "--set",
          "train.steps=2", "--set", f'train.out_dir="{vl}/run"')
    logits_file = os.path.join(vl, "logits.safetensors")
    fsdpp("eval", CONFIG, "--set", f'model.path="{vl}/run/checkpoints/step-00000002"', "--set",
          'model.dtype="float64"', "--max-windows", "2", "--logits", logits_file)
    engine = load_file(logits_file)
    model_class = transformers.Qwen2VLForConditionalGeneration
    loaded = PeftModel.from_pretrained(model_class.from_pretrained(base, dtype=torch.float64), f"{vl}/run/adapter")
    adapted = sum(1 for name, _ in loaded.named_parameters() if "lora_B" in name and "visual" in name)
    with torch.no_grad():
        err = ((loaded(engine["input_ids"]).logits - engine["logits"]).abs().max() / engine["logits"].abs().max()).item()
    ok = report(err <= 1e-5 and adapted > 0, f"Qwen2-VL: peft loads the run's adapter ({adapted} vision-tower "
                f"adapters among its factors): its logits vs fsdpp eval's {err:.2e} (allowed 1e-5)")
    # The other way: peft's adapter, with nonzero B factors, read by fsdpp eval.
    torch.manual_seed(5)
    made = get_peft_model(model_class.from_pretrained(base, dtype=torch.float64),
                          LoraConfig(r=2, lora_alpha=4, target_modules=["k_proj", "qkv"]))
    with torch.no_grad():
        for name, p in made.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    made.save_pretrained(f"{vl}/peft-made")
    fsdpp("eval", CONFIG, "--set", f'model.path="{base}"', "--set", f'model.adapter="{vl}/peft-made"', "--set",
          'model.dtype="float64"', "--max-windows", "2", "--logits", logits_file)
    engine = load_file(logits_file)
    with torch.no_grad():
        err = ((made(engine["input_ids"]).logits - engine["logits"]).abs().max() / engine["logits"].abs().max()).item()
    return ok and report(err <= 1e-5, f"Qwen2-VL: fsdpp eval with peft's own adapter gives peft's logits {err:.2e} "
                         "(allowed 1e-5)")


def check_moe_mlp_adapter_warning():
    """A mixture-of-experts model's adapter on an MLP projection, which peft over transformers 5
    drops (it reads such targets as the fused experts'), is written with a warning saying so;
    one on attention alone, which peft reads, without."""
    warned = {}
    for targets in ("q_proj,gate_proj", "q_proj"):
        out = os.path.join(WORK, "moe-" + targets.replace(",", "-"))
        shutil.rmtree(out, ignore_errors=True)
        proc = fsdpp("train", CONFIG, "--set", 'model.path="tests/assets/models/fsdp-qwen3-moe"', "--set",
                     "policy.options.lora_rank=2", "--set", f'policy.options.lora_targets="{targets}"', "--set",
                     "train.steps=1", "--set", f'train.out_dir="{out}"')
        warned[targets] = "drops these adapters without an error" in proc.stderr
    return report(warned == {"q_proj,gate_proj": True, "q_proj": False},
                  f"a MoE model's adapter on gate_proj is written with a warning that peft drops it, one on q_proj "
                  f"alone without: {warned}")


if __name__ == "__main__":
    main()
