#!/usr/bin/env python3
"""A GRPO-style RL loop over fsdpp, from Python, on the CPU: the model spells random words
backwards, a verifiable reward scores what it wrote, and a clipped-ratio loss moves it
towards the better of each prompt's samples.

Each step: PROMPTS prompts ("spell qfip backwards" in the model's chat template), SAMPLES
completions each, sampled token by token at temperature 1 with plain forward passes of
run.model (no serving engine), the optimizer's state offloaded meanwhile; a reward per completion (1 for the exact answer, else half
the share of characters in place); advantages the rewards less their prompt's mean, over
their prompt's spread; then UPDATES clipped-ratio updates on run.model.logprobs of the
completion tokens, against the sampling policy's log-probs. Prints the mean reward of each
step and, at the end, of the first and last STEPS // 4 steps; exits 1 unless it rose.

Run by examples/python/grpo_example.sh, which first warms the model up with a short
supervised fine-tune (the spelling is learnt from nothing otherwise, with no reward to
learn from): .venv/bin/python examples/python/grpo_reverse.py MODEL_DIR [--steps N]

The rewards measured on two cores, and how they depend on the warm-up: docs/python.md, "The
RL loop, phase by phase"."""
import argparse
import random
import sys

import torch
from transformers import AutoTokenizer

import fsdpp

PROMPTS, SAMPLES, UPDATES = 8, 8, 2
CLIP = 0.2
LETTERS = "abcdefghijklmnopqrstuvwxyz"


def reward(answer, word):
    """1 for the word spelt backwards, else half the share of its characters in place."""
    want = word[::-1]
    if answer == want:
        return 1.0
    return 0.5 * sum(a == b for a, b in zip(answer, want)) / len(want)


@torch.no_grad()
def sample(run, prompts, new_tokens, end):
    """Completions [rows, new_tokens] of prompts [rows, P] at temperature 1, token by token;
    tokens after a row's end-of-turn are sampled on but masked out."""
    ids = prompts
    for _ in range(new_tokens):
        logits = run.model(ids)[:, -1]  # [rows, V]
        ids = torch.cat([ids, torch.multinomial(torch.softmax(logits.float(), -1), 1)], 1)
    completions = ids[:, prompts.shape[1]:]
    ended = (completions == end).cumsum(1)
    mask = (ended == 0) | ((ended == 1) & (completions == end))  # up to and with the first end
    return ids, completions, mask


def step_batch(tok, rng):
    """PROMPTS words and their prompt rows, each repeated SAMPLES times: [rows, P]."""
    words = ["".join(rng.choice(LETTERS) for _ in range(4)) for _ in range(PROMPTS)]
    rows = [tok.apply_chat_template([{"role": "user", "content": f"spell {w} backwards"}], add_generation_prompt=True,
                                    tokenize=True, return_dict=True)["input_ids"] for w in words]
    return words, torch.tensor(rows).repeat_interleave(SAMPLES, 0)  # every word has 4 letters: one length


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", metavar="MODEL_DIR", help="the policy to train: an HF directory with its tokenizer")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--lr", type=float, default=None, help="the learning rate (default: grpo.toml's)")
    ap.add_argument("--out-dir", default=None, help="the run's out_dir (default: grpo.toml's)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    tok = AutoTokenizer.from_pretrained(args.model)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    overrides = {"model.path": args.model, "train.steps": args.steps * UPDATES}
    if args.lr is not None:
        overrides["optimizer.lr"] = args.lr
    if args.out_dir is not None:
        overrides["train.out_dir"] = args.out_dir
    run = fsdpp.Run("examples/python/grpo.toml", overrides=overrides)
    rewards = []
    for step in range(1, args.steps + 1):
        words, prompts = step_batch(tok, rng)
        # Sampling needs the weights alone: the optimizer's state leaves the device meanwhile,
        # as it would for a serving engine's memory.
        run.offload(("grads", "optimizer"))
        ids, completions, mask = sample(run, prompts, new_tokens=6, end=end)
        run.reload()
        answers = [tok.decode(c[m], skip_special_tokens=True).strip() for c, m in zip(completions, mask)]
        scores = torch.tensor([reward(a, words[i // SAMPLES]) for i, a in enumerate(answers)])  # [rows]
        groups = scores.view(PROMPTS, SAMPLES)
        advantages = ((groups - groups.mean(1, keepdim=True)) / (groups.std(1, keepdim=True) + 1e-4)).view(-1, 1)
        inputs, targets = ids[:, :-1], ids[:, 1:]
        first = prompts.shape[1] - 1  # the position predicting the first completion token
        weights = mask.float() / mask.sum()  # each completion token alike
        with torch.no_grad():
            old = run.model.logprobs(inputs, targets)[:, first:]  # [rows, new_tokens]
        for _ in range(UPDATES):
            logp = run.model.logprobs(inputs, targets)[:, first:]
            ratio = torch.exp(logp - old)
            objective = torch.min(ratio * advantages, ratio.clamp(1 - CLIP, 1 + CLIP) * advantages)
            (-(objective * weights).sum()).backward()
            run.step()
            run.zero_grad()
        rewards.append(scores.mean().item())
        exact = (scores == 1).float().mean().item()
        print(f"step {step:3d}  reward {rewards[-1]:.3f}  exact {exact:.0%}  e.g. {words[0]} -> {answers[0]!r}",
              flush=True)
    quarter = max(1, args.steps // 4)
    before, after = sum(rewards[:quarter]) / quarter, sum(rewards[-quarter:]) / quarter
    print(f"grpo: mean reward of the first {quarter} steps {before:.3f}, of the last {quarter} {after:.3f}")
    return 0 if after > before else 1


if __name__ == "__main__":
    sys.exit(main())
