# Writes tiny random HF checkpoints plus reference logits, loss and gradients computed by
# `transformers`, which the C++ parity tests load to check fsdpp's model implementations.
# Run with the project venv: .venv/bin/python tests/reference/make_hf_fixtures.py OUTDIR
import argparse
import json
import os
import sys
import time

import torch
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM
from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM
from transformers import AutoConfig, DeepseekV3Config, DeepseekV3ForCausalLM
from transformers.core_model_loading import revert_weight_conversion
from transformers.utils import logging

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts"))
import cpu_cap  # noqa: E402

cpu_cap.apply()  # before any torch kernel runs

# Odd sizes on purpose: powers of two hide indexing and stride mistakes.
COMMON = dict(
    vocab_size=101,
    hidden_size=48,
    intermediate_size=88,
    num_hidden_layers=2,
    num_attention_heads=6,
    num_key_value_heads=2,
    max_position_embeddings=64,
    # Large enough that logits differ clearly between positions and vocab entries.
    initializer_range=0.2,
    rms_norm_eps=1e-6,
    attention_dropout=0.0,
    # The plainest kernels as the reference: transformers' grouped expert product needs rows
    # of 16-byte multiples on a CPU, which these odd widths are not.
    attn_implementation="eager",
    experts_implementation="eager",
)
BATCH, SEQ = 2, 13
# Packed rows of SEQ tokens: documents (by their length) laid out row by row, the last row
# padded; each document's reference is the document run alone.
PACKED_ROWS = [[9, 4], [5, 8], [3]]
# One optimizer step after the reference backward, checked by the C++ parity test too.
CLIP_NORM, LR, BETAS, EPS, WEIGHT_DECAY = 0.5, 1e-2, (0.9, 0.95), 1e-8, 0.1
INPUT_SEED = 20240601

LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}


def context_outside_block(config):
    """Phi-3's layout: the pre-extension context at the top of config.json alone, and YaRN's
    factor left null for transformers to derive from it."""
    config["rope_parameters"].pop("original_max_position_embeddings")
    config["rope_parameters"]["factor"] = None


# name -> (seed, model class, config, extra save_pretrained arguments; "edit": a change made
# to the saved config.json, which transformers must read back to the same model)
MODELS = {
    "llama_untied": (1, LlamaForCausalLM,
                     LlamaConfig(**COMMON, tie_word_embeddings=False, rope_theta=10000.0), {}),
    "llama_tied_rope3": (2, LlamaForCausalLM,
                         LlamaConfig(**COMMON, tie_word_embeddings=True, rope_theta=500000.0,
                                     rope_scaling=LLAMA3_SCALING), {}),
    "qwen2": (3, Qwen2ForCausalLM, Qwen2Config(**COMMON, tie_word_embeddings=True), {}),
    "qwen3": (4, Qwen3ForCausalLM,
              Qwen3Config(**COMMON, head_dim=12, tie_word_embeddings=False, attention_bias=False),
              {}),
    # A window shorter than the sequence and than the longest packed document.
    "mistral": (6, MistralForCausalLM, MistralConfig(**COMMON, sliding_window=5, tie_word_embeddings=False), {}),
    # Routing to 3 of 7 experts, a dense layer between two MoE layers; the load-balancing loss
    # weighted to matter in the loss and its gradients.
    "qwen3_moe": (7, Qwen3MoeForCausalLM,
                  Qwen3MoeConfig(**{**COMMON, "num_hidden_layers": 3}, head_dim=12, num_experts=7,
                                 num_experts_per_tok=3, moe_intermediate_size=20, norm_topk_prob=True,
                                 mlp_only_layers=[1], router_aux_loss_coef=0.05, output_router_logits=True,
                                 tie_word_embeddings=False), {}),
    # Every second layer MoE (decoder_sparse_step), the first dense.
    "qwen3_moe_unnormed": (8, Qwen3MoeForCausalLM,
                           Qwen3MoeConfig(**COMMON, head_dim=12, num_experts=5, num_experts_per_tok=2,
                                          moe_intermediate_size=18, norm_topk_prob=False, decoder_sparse_step=2,
                                          router_aux_loss_coef=0.05, output_router_logits=True,
                                          tie_word_embeddings=True), {}),
    # Latent attention with a query bottleneck, YaRN with both mscales, interleaved rotary
    # weights; 3 of 12 experts from the best 2 of 3 groups, 2 shared experts, a dense first
    # layer. Without the bottleneck: one group, no renormalisation, plain RoPE.
    "deepseek_v3": (9, DeepseekV3ForCausalLM,
                    DeepseekV3Config(**{**COMMON, "num_hidden_layers": 3, "num_key_value_heads": 6},
                                     q_lora_rank=20, kv_lora_rank=14, qk_nope_head_dim=10, qk_rope_head_dim=6,
                                     v_head_dim=8, n_routed_experts=12, n_group=3, topk_group=2,
                                     num_experts_per_tok=3, n_shared_experts=2, moe_intermediate_size=10,
                                     first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
                                     rope_interleave=True, tie_word_embeddings=False,
                                     rope_scaling={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0,
                                                   "beta_slow": 1.0, "mscale": 0.9, "mscale_all_dim": 0.8,
                                                   "original_max_position_embeddings": 16}), {}),
    "deepseek_v3_plain": (10, DeepseekV3ForCausalLM,
                          DeepseekV3Config(**{**COMMON, "num_key_value_heads": 6}, q_lora_rank=None,
                                           kv_lora_rank=14, qk_nope_head_dim=10, qk_rope_head_dim=6, v_head_dim=12,
                                           n_routed_experts=6, n_group=1, topk_group=1, num_experts_per_tok=2,
                                           n_shared_experts=1, moe_intermediate_size=10, first_k_dense_replace=0,
                                           routed_scaling_factor=1.5, norm_topk_prob=False, rope_interleave=False,
                                           tie_word_embeddings=True), {}),
    # A padding token in every row, whose embedding row gets no gradient but the tied head's;
    # YaRN over a context given outside its block, with the factor derived from it.
    "llama_yarn_pad": (11, LlamaForCausalLM,
                       LlamaConfig(**COMMON, tie_word_embeddings=True, pad_token_id=7,
                                   original_max_position_embeddings=16,
                                   rope_scaling={"rope_type": "yarn", "factor": 4.0}),
                       {"edit": context_outside_block}),
    # DeepSeek-V3 scales its softmax by mscale_all_dim under any scaling but the default.
    "deepseek_v3_linear": (12, DeepseekV3ForCausalLM,
                           DeepseekV3Config(**{**COMMON, "num_key_value_heads": 6}, q_lora_rank=None,
                                            kv_lora_rank=14, qk_nope_head_dim=10, qk_rope_head_dim=6, v_head_dim=12,
                                            n_routed_experts=6, n_group=1, topk_group=1, num_experts_per_tok=2,
                                            n_shared_experts=1, moe_intermediate_size=10, first_k_dense_replace=0,
                                            tie_word_embeddings=False,
                                            rope_scaling={"rope_type": "linear", "factor": 2.0,
                                                          "mscale_all_dim": 0.8}), {}),
    "llama_sharded": (5, LlamaForCausalLM,
                      LlamaConfig(**COMMON, tie_word_embeddings=False, rope_theta=10000.0),
                      {"max_shard_size": "20KB"}),
}


def by_checkpoint_name(model, tensors, prefix):
    """`tensors` (one per parameter, by parameter name) under the names the checkpoint holds,
    each with `prefix`: transformers keeps a MoE layer's experts fused in memory
    (experts.gate_up_proj [E, 2I, C], experts.down_proj [E, C, I]) and splits them one by one
    when it saves, as fsdpp names them; its own save-time conversion does the split."""
    return {prefix + n: t.contiguous() for n, t in revert_weight_conversion(model, dict(tensors)).items()}


def edit_config(directory, edit, model):
    """Applies `edit` to the saved config.json and makes sure transformers reads the edited file
    to the model the references come from: the same rotary frequencies and scaling."""
    path = os.path.join(directory, "config.json")
    with open(path) as f:
        config = json.load(f)
    edit(config)
    with open(path, "w") as f:
        json.dump(config, f, indent=2)
    again = type(model)(AutoConfig.from_pretrained(directory)).model.rotary_emb
    if not (torch.equal(again.inv_freq, model.model.rotary_emb.inv_freq)
            and again.attention_scaling == model.model.rotary_emb.attention_scaling):
        fail(f"{directory}: transformers reads the edited config.json to another RoPE")


def fail(msg):
    print(f"make_hf_fixtures: {msg}", file=sys.stderr)
    sys.exit(2)


def perturb(model):
    # HF initialises norm weights to 1 and biases to 0, which would let a port that skips
    # the norm scale or the q/k/v bias pass; move them away from those values.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias")):
                p.copy_(0.2 * torch.randn_like(p))
        # DeepSeek-V3's routing bias starts at 0, where a port that ignores it would pass; below
        # the sigmoid scores, so that biased scores are negative and experts outside the best
        # groups must be masked below them, not to 0.
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(-1.0 + 0.05 * torch.randn_like(b))


def packed_reference(model, gen, vocab_size):
    """What rows packing several documents must give: the logits of each document run alone,
    placed where it sits in its row, and the mean loss over the documents' targets (all of
    them, and a random half: a loss mask) with its gradients. Positions restart at every
    document; padding has no logits and no targets."""
    rows, offsets = len(PACKED_ROWS), []
    input_ids = torch.zeros(rows, SEQ, dtype=torch.int64)
    targets = torch.full((rows, SEQ), -100, dtype=torch.int64)
    logits = torch.zeros(rows, SEQ, vocab_size)
    documents = []
    for r, lengths in enumerate(PACKED_ROWS):
        at = 0
        for length in lengths:
            offsets.append(r * SEQ + at)
            ids = torch.randint(0, vocab_size, (length,), generator=gen, dtype=torch.int64)
            input_ids[r, at:at + length] = ids
            targets[r, at:at + length - 1] = ids[1:]
            documents.append((r, at, ids))
            at += length
        if at < SEQ:
            offsets.append(r * SEQ + at)
    offsets.append(rows * SEQ)
    marked = torch.rand(rows, SEQ, generator=gen) < 0.5
    ref = {"packed.input_ids": input_ids, "packed.offsets": torch.tensor(offsets, dtype=torch.int64),
           "packed.targets": targets, "packed.marked": marked.to(torch.uint8)}
    params = list(model.named_parameters())
    for variant, labels in (("packed", targets), ("packed_masked", targets.masked_fill(~marked, -100))):
        total = 0.0
        for r, at, ids in documents:
            out = model(ids[None]).logits[0]  # [L, V]
            if variant == "packed":
                logits[r, at:at + len(ids)] = out.detach()
            total = total + torch.nn.functional.cross_entropy(out, labels[r, at:at + len(ids)], ignore_index=-100,
                                                              reduction="sum")
        loss = total / (labels != -100).sum()
        # An expert no token reached has no gradient here; the engine's is zero.
        grads = torch.autograd.grad(loss, [p for _, p in params], allow_unused=True)
        ref[f"{variant}.loss"] = loss.detach().reshape(())
        ref.update(by_checkpoint_name(model, ((n, torch.zeros_like(p) if g is None else g.detach().clone())
                                              for (n, p), g in zip(params, grads)), f"{variant}.grad."))
    ref["packed.logits"] = logits
    return ref


def make_one(outdir, name, seed, cls, config, save_args):
    torch.manual_seed(seed)
    model = cls(config)
    perturb(model)
    model.train()

    gen = torch.Generator().manual_seed(INPUT_SEED)
    input_ids = torch.randint(0, config.vocab_size, (BATCH, SEQ), generator=gen, dtype=torch.int64)
    if config.pad_token_id is not None:
        input_ids[:, 2] = config.pad_token_id
    # DeepSeek-V3's routers return the experts they chose: kept by a hook, layer by layer.
    chosen = []
    hooks = [m.register_forward_hook(lambda _m, _i, out: chosen.append(out[-1].detach()))
             for n, m in model.named_modules() if type(m).__name__ == "DeepseekV3TopkRouter"]
    out = model(input_ids, labels=input_ids)
    for h in hooks:
        h.remove()
    out.loss.backward()

    ref = {
        "input_ids": input_ids,
        "logits": out.logits.detach().contiguous(),
        "loss": out.loss.detach().reshape(()),
    }
    # The experts each MoE layer chose per token (in ascending order), and Qwen3-MoE's
    # load-balancing loss, already inside out.loss.
    if getattr(config, "output_router_logits", False):
        ref["aux_loss"] = out.aux_loss.detach().reshape(())
        chosen = [torch.topk(logits.softmax(-1), config.num_experts_per_tok, -1).indices for logits in out.router_logits]
    for i, selected in enumerate(chosen):
        ref[f"selected.{i}"] = selected.sort(-1).values.contiguous()
    for p in model.parameters():
        if p.grad is None:  # an expert no token reached: the engine's gradient is zero
            p.grad = torch.zeros_like(p)
    # Copies: clipping below scales p.grad in place.
    ref.update(by_checkpoint_name(model, ((n, p.grad.detach().clone()) for n, p in model.named_parameters()), "grad."))

    ref.update(packed_reference(model, gen, config.vocab_size))

    # The checkpoint holds the weights the reference outputs came from, before the step.
    d = os.path.join(outdir, name)
    os.makedirs(d, exist_ok=True)
    save_args = dict(save_args)
    edit = save_args.pop("edit", None)
    model.save_pretrained(d, **save_args)
    if edit:
        edit_config(d, edit, model)

    # Clip by the global norm, then one AdamW step with decay on matrices only.
    ref["grad_norm"] = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP_NORM).reshape(())
    named = list(model.named_parameters())
    opt = torch.optim.AdamW(
        [{"params": [p for _, p in named if p.ndim >= 2], "weight_decay": WEIGHT_DECAY},
         {"params": [p for _, p in named if p.ndim < 2], "weight_decay": 0.0}],
        lr=LR, betas=BETAS, eps=EPS, foreach=False)
    opt.step()
    ref.update(by_checkpoint_name(model, ((n, p.detach().clone()) for n, p in named), "updated."))

    save_file(ref, os.path.join(d, "reference.safetensors"))
    shards = sum(f.endswith(".safetensors") and f != "reference.safetensors" for f in os.listdir(d))
    print(f"{name}: {sum(p.numel() for p in model.parameters())} params, {shards} shard(s), "
          f"loss {out.loss.item():.6f} -> {d}")


def main():
    ap = argparse.ArgumentParser(
        description="Write tiny random Llama/Mistral/Qwen2/Qwen3/Qwen3-MoE/DeepSeek-V3 HF checkpoints with reference logits, "
        "loss and gradients into OUTDIR/<model>/ for the C++ parity tests.")
    ap.add_argument("outdir", metavar="OUTDIR", help="directory to write the fixtures into")
    ap.error = fail
    args = ap.parse_args()

    torch.set_num_threads(1)
    logging.disable_progress_bar()
    t0 = time.perf_counter()
    try:
        for name, (seed, cls, config, save_args) in MODELS.items():
            make_one(args.outdir, name, seed, cls, config, save_args)
    except OSError as e:
        fail(f"cannot write into {args.outdir}: {e}")
    print(f"done in {time.perf_counter() - t0:.1f}s")


if __name__ == "__main__":
    main()
