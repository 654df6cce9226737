#!/usr/bin/env python3
"""Makes the chat fine-tuning example's inputs on the spot, with no download: a small
character-level tokenizer with a chat template, a small Llama saved by transformers beside
it, and chats of a task whose answers can be checked (spelling a random four-letter word
backwards), split into a training and a held-out JSONL file. scripts/sft_example.sh turns them into token files and
trains examples/sft-chat.toml on them.

Run with the project venv: .venv/bin/python scripts/make_sft_example.py OUT_DIR"""
import argparse
import json
import os
import random
import sys

TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHARS = "abcdefghijklmnopqrstuvwxyz0123456789 ,.?!+=\n"


def make_tokenizer(path, chars=CHARS, template=TEMPLATE):
    """One token per character and per special token, with `template` as the chat template,
    saved by transformers as a model's tokenizer is."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(SPECIALS + sorted(set(chars)))}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=SPECIALS[0]))  # no merges: a character each
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token=SPECIALS[0], additional_special_tokens=SPECIALS[1:])
    tok.chat_template = template
    tok.save_pretrained(path)
    return tok


def make_model(path, vocab_size, seed):
    """A small Llama (about 0.4M parameters) initialised by transformers."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=128, intermediate_size=344, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=0)
    model = LlamaForCausalLM(config)
    model.save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


def chat(rng):
    word = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(4))
    return {"messages": [{"role": "user", "content": f"spell {word} backwards"},
                         {"role": "assistant", "content": word[::-1]}]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", metavar="OUT_DIR")
    ap.add_argument("--train", type=int, default=4000, help="training chats (default %(default)s)")
    ap.add_argument("--heldout", type=int, default=200, help="held-out chats (default %(default)s)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.train < 1 or args.heldout < 1:
        ap.error("--train and --heldout take at least 1")
    model_dir = os.path.join(args.out, "model")
    os.makedirs(model_dir, exist_ok=True)
    tok = make_tokenizer(model_dir)
    params = make_model(model_dir, len(tok), args.seed)
    rng = random.Random(args.seed)
    for name, count in (("train", args.train), ("heldout", args.heldout)):
        with open(os.path.join(args.out, f"{name}.jsonl"), "w") as f:
            for _ in range(count):
                f.write(json.dumps(chat(rng)) + "\n")
    print(f"make_sft_example: a {params}-parameter Llama and its tokenizer in {model_dir}; "
          f"{args.train} training and {args.heldout} held-out chats in {args.out}")


if __name__ == "__main__":
    sys.exit(main())
