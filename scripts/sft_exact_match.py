#!/usr/bin/env python3
"""Held-out exact match for the chat fine-tuning example: transformers loads MODEL_DIR whole
(an fsdpp export, or the model before fine-tuning: its weights and its tokenizer), greedily
answers each held-out chat's question through the tokenizer's chat template, and counts the
answers equal to the reference one. Prints one JSON object: {"exact_match": share, "chats": count}.

Run with the project venv: .venv/bin/python scripts/sft_exact_match.py MODEL_DIR HELDOUT_JSONL"""
import argparse
import json

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("heldout")
    args = ap.parse_args()
    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    end = tok.convert_tokens_to_ids("<|im_end|>")
    chats = [json.loads(line)["messages"] for line in open(args.heldout)]
    right = 0
    with torch.no_grad():
        for messages in chats:
            prompt = tok.apply_chat_template(messages[:-1], add_generation_prompt=True, return_tensors="pt",
                                             return_dict=True)["input_ids"]
            out = model.generate(prompt, max_new_tokens=24, do_sample=False, eos_token_id=end,
                                 pad_token_id=tok.eos_token_id)
            answer = tok.decode(out[0, prompt.shape[1]:], skip_special_tokens=True).strip()
            right += answer == messages[-1]["content"]
    print(json.dumps({"exact_match": right / len(chats), "chats": len(chats)}))


if __name__ == "__main__":
    main()
