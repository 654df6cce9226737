# Writes tiny random HF base models, PEFT LoRA adapters on them and the reference logits,
# loss and adapter gradients `peft` computes, which the C++ parity test loads to check
# fsdpp's LoRA. Run with the project venv: .venv/bin/python tests/reference/make_lora_fixtures.py OUTDIR
import argparse
import os
import sys

import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_hf_fixtures import BATCH, COMMON, INPUT_SEED, SEQ, fail, perturb  # noqa: E402

# Rank 3 (not a power of two), adapters in attention and in the MLP; the Qwen2 model also
# trains every norm and its embedding (PEFT's modules_to_save, named as PEFT users name them:
# by the end of a module's path, "norm" taking input_layernorm and the rest).
MODELS = {
    "lora_llama": (11, LlamaForCausalLM, LlamaConfig(**COMMON, tie_word_embeddings=False),
                   LoraConfig(r=3, lora_alpha=7, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "down_proj"])),
    "lora_qwen2": (12, Qwen2ForCausalLM, Qwen2Config(**COMMON, tie_word_embeddings=False),
                   LoraConfig(r=5, lora_alpha=16, lora_dropout=0.0, target_modules=["k_proj", "o_proj", "up_proj"],
                              modules_to_save=["norm", "embed_tokens"])),
}


def make_one(outdir, name, seed, cls, config, lora):
    torch.manual_seed(seed)
    base = cls(config)
    perturb(base)
    d = os.path.join(outdir, name)
    base.save_pretrained(os.path.join(d, "base"))
    model = get_peft_model(base, lora)
    with torch.no_grad():  # B starts at zero, where A would get no gradient: move it
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(0.1 * torch.randn_like(p))
    model.save_pretrained(os.path.join(d, "adapter"))
    model.train()
    gen = torch.Generator().manual_seed(INPUT_SEED)
    input_ids = torch.randint(0, config.vocab_size, (BATCH, SEQ), generator=gen, dtype=torch.int64)
    out = model(input_ids=input_ids, labels=input_ids)
    out.loss.backward()
    ref = {"input_ids": input_ids, "logits": out.logits.detach().contiguous(), "loss": out.loss.detach().reshape(())}
    for n, p in model.named_parameters():
        if p.requires_grad:  # engine names: PEFT's prefix and adapter name dropped
            engine = n.removeprefix("base_model.model.").replace(".default.", ".").replace(".modules_to_save.", ".")
            ref[f"grad.{engine}"] = p.grad.detach().clone()
    save_file(ref, os.path.join(d, "reference.safetensors"))
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    print(f"{name}: {trained} trainable parameters, loss {out.loss.item():.6f} -> {d}")


def main():
    ap = argparse.ArgumentParser(description="Write tiny HF base models with PEFT LoRA adapters and peft's "
                                 "reference logits, loss and gradients into OUTDIR/<name>/.")
    ap.add_argument("outdir", metavar="OUTDIR")
    ap.error = fail
    args = ap.parse_args()
    torch.set_num_threads(1)
    for name, (seed, cls, config, lora) in MODELS.items():
        make_one(args.outdir, name, seed, cls, config, lora)


if __name__ == "__main__":
    main()
