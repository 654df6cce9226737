#!/usr/bin/env python3
# The float8 recipe's rounding (engine/models/fp8_product.h), emulated on the CPU: a narrow
# Llama with the 1.1B bench's corpus, optimiser and schedule trains three times from the same
# weights and batches, its decoder layers' products taking
#   bf16   operands rounded to bf16 (the reference),
#   fp8    the forward and the input's gradient from operands scaled per row (per column of the
#          weight for the gradient) by powers of two and rounded to e4m3, the weight's gradient
#          from bf16 operands; each result rounded to bf16, as at::_scaled_mm returns it,
#   fp8-truncated  as fp8, with the forward's sum kept in an accumulator that truncates to
#          --accumulator-bits mantissa bits after every 32 products, as Hopper's fast
#          accumulation is measured to,
# each product summed exactly in float32 otherwise. It tells whether rounding alone parts a
# float8 run's losses from bf16's, on a machine without FP8 matrix units.
# Run from the repository root: .venv/bin/python scripts/fp8_emulation.py [--layers 8 --hidden 512]
import argparse
import sys

import torch

from bench_common import BenchError, WindowSampler, lr_at, read_tokens, read_toml

E4M3_MAX_EXPONENT = 9  # 448 = 0.875 * 2^9, e4m3's largest finite value
SMALLEST_AMAX = 1e-30  # a row of zeros scales as one of this (kSmallestFp8Amax): its factor stays finite


def bf16(t):
    return t.to(torch.bfloat16).float()


def e4m3_rows(x):
    """x [R, C] with each row scaled by the largest power of two that keeps it within ±448,
    rounded to e4m3 and restored: the operand the matrix units see, in float32."""
    amax = x.abs().amax(1, keepdim=True).clamp_min(SMALLEST_AMAX)
    mantissa, exponent = torch.frexp(amax)
    k = E4M3_MAX_EXPONENT - exponent - (mantissa > 0.875).int()
    factor = torch.ldexp(torch.ones_like(amax), k)
    return (x * factor).to(torch.float8_e4m3fn).float() / factor


def truncated_sum_product(a, b, bits):
    """a [M, K] times b [K, N], summed 32 products at a time into an accumulator whose
    mantissa is truncated to `bits` bits after each addition."""
    mask = ~((1 << (23 - bits)) - 1)
    acc = torch.zeros(a.shape[0], b.shape[1])
    for k in range(0, a.shape[1], 32):
        acc = ((acc + a[:, k:k + 32] @ b[k:k + 32]).view(torch.int32) & mask).view(torch.float32)
    return acc


def emulated_linear(variant, bits):
    class Product(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, weight):  # x [..., K], weight [N, K]
            ctx.save_for_backward(x, weight)
            rows = bf16(x.reshape(-1, x.shape[-1]))  # [M, K]
            if variant == "bf16":
                out = rows @ bf16(weight).t()
            elif variant == "fp8":
                out = e4m3_rows(rows) @ e4m3_rows(bf16(weight)).t()
            else:
                out = truncated_sum_product(e4m3_rows(rows), e4m3_rows(bf16(weight)).t(), bits)
            return bf16(out).view(*x.shape[:-1], weight.shape[0])  # [..., N]

        @staticmethod
        def backward(ctx, grad):
            x, weight = ctx.saved_tensors
            g = bf16(grad.reshape(-1, weight.shape[0]))  # [M, N]
            rows = bf16(x.reshape(-1, x.shape[-1]))  # [M, K]
            if variant == "bf16":
                grad_x = g @ bf16(weight)
            else:  # the weight scaled per column: its transpose's rows
                grad_x = e4m3_rows(g) @ e4m3_rows(bf16(weight).t().contiguous()).t()
            return bf16(grad_x).view(x.shape), bf16(g.t() @ rows)

    return Product.apply


def train(variant, args, cfg, tokens):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4 // 16 * 16,
        num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
        num_key_value_heads=max(1, args.hidden // 512), max_position_embeddings=args.seq_len))
    product = emulated_linear(variant, args.accumulator_bits)
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and ".layers." in f".{name}":
            module.forward = lambda x, m=module: product(x, m.weight)
    opt = torch.optim.AdamW(model.parameters(), lr=lr_at(1, cfg), weight_decay=float(cfg["optimizer"]["weight_decay"]),
                            betas=(0.9, float(cfg["optimizer"]["beta2"])))
    sampler = WindowSampler(tokens, args.seq_len)
    losses = []
    for step in range(1, args.steps + 1):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        batch = torch.from_numpy(sampler.take(args.batch_size))  # [B, T + 1]
        logits = model(input_ids=batch[:, :-1]).logits  # [B, T, V]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, args.vocab).float(), batch[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), float(cfg["train"]["clip_grad_norm"]))
        opt.step()
        losses.append(loss.item())
    return losses


def main():
    ap = argparse.ArgumentParser(description="The float8 recipe's rounding emulated on the CPU: a narrow Llama "
                                 "trained in bf16, fp8 and fp8 with a truncating accumulator, from the same weights "
                                 "and batches.")
    ap.add_argument("--config", default="examples/llama-1b-gpu.toml",
                    help="the run whose corpus, optimiser and schedule are used (default: %(default)s)")
    ap.add_argument("--steps", type=int, default=300, help="steps per variant (default: %(default)s)")
    ap.add_argument("--layers", type=int, default=4, help="decoder layers (default: %(default)s)")
    ap.add_argument("--hidden", type=int, default=256, help="hidden width, a multiple of 64 (default: %(default)s)")
    ap.add_argument("--seq-len", type=int, default=256, help="tokens per row (default: %(default)s)")
    ap.add_argument("--batch-size", type=int, default=8, help="rows per step (default: %(default)s)")
    ap.add_argument("--accumulator-bits", type=int, default=13, choices=range(1, 24), metavar="1..23",
                    help="mantissa bits fp8-truncated's accumulator keeps (default: %(default)s)")
    ap.add_argument("--seed", type=int, default=1234, help="initial weights' seed (default: %(default)s)")
    args = ap.parse_args()
    if args.hidden % 64 or args.hidden < 64:
        ap.error("--hidden must be a positive multiple of 64")
    torch.set_num_threads(1)
    try:
        cfg = read_toml(args.config)
        cfg.setdefault("train", {})["steps"] = args.steps  # the schedule spans this run
        tokens, args.vocab = read_tokens(cfg["data"]["train"])
    except (BenchError, KeyError) as e:
        sys.exit(f"fp8_emulation: {e}")
    runs = {variant: train(variant, args, cfg, tokens) for variant in ("bf16", "fp8", "fp8-truncated")}
    shown = sorted({s for s in (1, 2, 5, 10, 15, 25, 50, 100, 200, args.steps) if s <= args.steps})
    print(f"{'step':>6}" + "".join(f"{v:>15}" for v in runs))
    for s in shown:
        print(f"{s:>6}" + "".join(f"{losses[s - 1]:>15.4f}" for losses in runs.values()))
    tail = min(10, args.steps)
    reference = sum(runs["bf16"][-tail:]) / tail
    for variant, losses in runs.items():
        mean = sum(losses[-tail:]) / tail
        print(f"{variant}: mean of the last {tail} steps' losses {mean:.4f} ({(mean - reference) / reference:+.2e} "
              "relative to bf16)")


if __name__ == "__main__":
    main()
