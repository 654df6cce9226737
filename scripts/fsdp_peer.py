#!/usr/bin/env python3
# The benchmarks' peer: the same model, batches and optimiser trained by PyTorch's own FSDP2
# (torch.distributed.fsdp.fully_shard) with the plan of fsdpp's shipped policies, one process
# per rank, writing a metrics.jsonl in fsdpp's format. bench_fsdp.py starts it as
# `bench_fsdp.py --torch-worker`.
import json
import math
import os
import time

from bench_common import (BenchError, WindowSampler, experts_kernel, get, global_load_balancing_loss, lr_at,
                          read_toml, read_tokens)


def load_config(path, steps, seq_len=None, batch_size=None):
    """The run file as both engines run it: `steps` steps, windows in file order, and the
    sequence length and batch size given (the file's where None)."""
    cfg = read_toml(path)
    cfg.setdefault("train", {})["steps"] = steps
    for key, value in (("seq_len", seq_len), ("batch_size", batch_size)):
        if value is not None:
            cfg.setdefault("data", {})[key] = value
    # Windows in file order: the two engines shuffle with different generators, and the
    # same batches are what makes their losses comparable step by step.
    cfg.setdefault("data", {})["shuffle"] = False
    return cfg


# ---------------------------------------------------------------- PyTorch FSDP2 worker


def write_initial_adapter(init_dir, rank, targets, out_dir):
    """A fresh PEFT adapter on the initial model (B zero, A as peft draws it), which both
    engines start from: the same initial A makes their losses comparable step by step."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(init_dir, dtype=torch.float32)
    get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets)).save_pretrained(out_dir)
    return out_dir


def build_sharded_model(cfg, world, init_dir, device, param_dtype, activation_checkpoint=False, offload=False,
                        adapter_dir=None, compile_layers=False):
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
    from transformers import AutoModelForCausalLM

    if get(cfg, "model.dtype", "float32") != "float32":
        raise BenchError("only model.dtype = \"float32\" is benchmarked")
    if not hasattr(FSDPModule, "set_gradient_divide_factor"):
        raise BenchError(f"torch {torch.__version__} lacks FSDPModule.set_gradient_divide_factor")
    # Offloaded, the weights stay on the host and fully_shard moves its shards there.
    compute_bytes = getattr(torch, param_dtype).itemsize if param_dtype else 4
    model = AutoModelForCausalLM.from_pretrained(init_dir, dtype=torch.float32, attn_implementation="sdpa",
                                                 **experts_kernel(init_dir, compute_bytes))
    if adapter_dir:  # peft's LoRA on the frozen base, sharded as the rest
        from peft import PeftModel
        model = PeftModel.from_pretrained(model, adapter_dir, is_trainable=True)
    if not offload:
        model = model.to(device)
    hf_config = model.config
    base = model.get_base_model() if adapter_dir else model
    if activation_checkpoint:  # each decoder layer recomputed in backward, as fsdpp's policy option
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    mesh = init_device_mesh(device, (world,))
    # fp32 masters with compute in param_dtype and fp32 reductions, as fsdpp's param_dtype.
    mp = MixedPrecisionPolicy(param_dtype=getattr(torch, param_dtype) if param_dtype else None,
                              reduce_dtype=torch.float32)
    options = dict(mesh=mesh, mp_policy=mp, offload_policy=CPUOffloadPolicy() if offload else OffloadPolicy())
    # The plan of fsdpp's shipped policies (policies/lib/fsdp.lua): a unit per layer, the
    # embedding and lm_head (one unit when tied), the root keeping the rest gathered.
    for layer in base.model.layers:
        if compile_layers:  # torchtitan's recipe: each decoder layer compiled, then sharded
            layer.compile()
        fully_shard(layer, reshard_after_forward=True, **options)
    if hf_config.tie_word_embeddings:
        fully_shard([base.model.embed_tokens, base.lm_head], reshard_after_forward=True, **options)
    else:
        fully_shard(base.model.embed_tokens, reshard_after_forward=True, **options)
        fully_shard(base.lm_head, reshard_after_forward=True, **options)
    fully_shard(model, reshard_after_forward=False, **options)
    # fsdpp sums gradients over ranks and divides the loss by the global token count; FSDP2
    # averages by default. A factor of 1 makes it sum, and forcing plain SUM reductions keeps
    # it off NCCL's PreMulSum, which gloo does not have. Both settings are per unit.
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    return model


def loss_scaler(cfg, param_dtype, device):
    """For float16 compute, PyTorch's ShardedGradScaler with the run file's [loss_scale]
    settings (fsdpp's defaults where absent), as a fully_shard user trains in float16; else
    none."""
    if param_dtype != "float16" or get(cfg, "loss_scale.mode", "auto") == "off":
        return None
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
    return ShardedGradScaler(device=device, init_scale=float(get(cfg, "loss_scale.init_scale", 65536.0)),
                             growth_factor=float(get(cfg, "loss_scale.growth_factor", 2.0)),
                             backoff_factor=float(get(cfg, "loss_scale.backoff_factor", 0.5)),
                             growth_interval=int(get(cfg, "loss_scale.growth_interval", 2000)))


def torch_worker(args):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.tensor import DTensor

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    cfg = load_config(args.config, args.steps, args.seq_len, args.batch_size)
    torch.set_num_threads(args.threads)
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    try:
        seq_len = int(get(cfg, "data.seq_len"))
        batch = int(get(cfg, "data.batch_size"))
        if batch % world != 0:
            raise BenchError(f"data.batch_size {batch} is not a multiple of the world size {world}")
        rows = batch // world
        tokens, file_vocab = read_tokens(get(cfg, "data.train"))
        held_out = int(len(tokens) * float(get(cfg, "data.eval_fraction", 0.0)))
        sampler = WindowSampler(tokens[:len(tokens) - held_out], seq_len)

        model = build_sharded_model(cfg, world, args.init_dir, args.device, args.param_dtype,
                                    args.activation_checkpoint, args.offload, args.adapter_dir, args.compile)
        if file_vocab > model.config.vocab_size:
            raise BenchError(f"token file vocab {file_vocab} exceeds model vocab "
                             f"{model.config.vocab_size}")
        model.train()
        balanced = (getattr(model.config, "router_aux_loss_coef", None) or 0) > 0  # Qwen3-MoE
        params = [p for p in model.parameters() if p.requires_grad]  # a LoRA run's frozen base has no state
        scaler = loss_scaler(cfg, args.param_dtype, args.device)
        opt = torch.optim.AdamW(
            [{"params": [p for p in params if p.ndim >= 2],
              "weight_decay": float(get(cfg, "optimizer.weight_decay", 0.0))},
             {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
            lr=float(get(cfg, "optimizer.lr")),
            betas=(float(get(cfg, "optimizer.beta1", 0.9)),
                   float(get(cfg, "optimizer.beta2", 0.999))),
            eps=float(get(cfg, "optimizer.eps", 1e-8)),
            # fsdpp's AdamW is fused too; the fused kernel fails beside ShardedGradScaler in
            # torch 2.11 (its found_inf has a shape the step counts do not), so a scaled run
            # takes the multi-tensor one.
            fused=scaler is None, foreach=scaler is not None)

        steps = int(get(cfg, "train.steps"))
        accum = int(get(cfg, "train.grad_accum", 1))
        clip = float(get(cfg, "train.clip_grad_norm", 0.0))
        step_tokens = accum * batch * seq_len
        metrics = None
        if rank == 0:
            os.makedirs(args.out_dir, exist_ok=True)
            metrics = open(os.path.join(args.out_dir, "metrics.jsonl"), "w")

        begin = time.perf_counter()
        profiler = counter = None
        for step in range(1, steps + 1):
            if step == args.count_step:  # fsdpp's own counter, as [metrics] count_step runs it
                import fsdpp
                counter = fsdpp.count_ops().__enter__()
            if step == args.profile_step:
                activities = [torch.profiler.ProfilerActivity.CPU]
                if args.device == "cuda":
                    activities.append(torch.profiler.ProfilerActivity.CUDA)
                profiler = torch.profiler.profile(activities=activities)
                profiler.start()
            step_begin = time.perf_counter()
            lr = lr_at(step, cfg)
            for group in opt.param_groups:
                group["lr"] = lr
            opt.zero_grad(set_to_none=True)
            loss_sum = torch.zeros((), dtype=torch.float64, device=args.device)
            for _ in range(accum):
                window = torch.from_numpy(sampler.take(batch)[rank * rows:(rank + 1) * rows]).to(args.device)
                out = model(input_ids=window[:, :-1], use_cache=False, output_router_logits=balanced)
                loss = F.cross_entropy(out.logits.reshape(-1, out.logits.shape[-1]).float(),
                                       window[:, 1:].reshape(-1), reduction="sum") / step_tokens
                if balanced:  # the load-balancing loss transformers adds in training, over all ranks as fsdpp's
                    loss = loss + model.config.router_aux_loss_coef * global_load_balancing_loss(
                        out.router_logits, model.config.num_experts_per_tok) / accum
                (scaler.scale(loss) if scaler else loss).backward()
                loss_sum += loss.detach().double()
            dist.all_reduce(loss_sum)  # fsdpp reports the global loss the same way
            scale = scaler.get_scale() if scaler else None
            if scaler:
                scaler.unscale_(opt)
            if clip > 0:
                norm = torch.nn.utils.clip_grad_norm_(params, clip)
            else:
                norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
            if isinstance(norm, DTensor):
                norm = norm.full_tensor()
            grad_norm = norm.item()
            if scaler:
                scaler.step(opt)  # skipped where the gradients overflowed on any rank
                scaler.update()
            else:
                opt.step()
            if counter is not None:
                counter.__exit__(None, None, None)
                os.makedirs(args.out_dir, exist_ok=True)
                with open(os.path.join(args.out_dir, f"ops-step-{step}-rank-{rank}.json"), "w") as f:
                    json.dump(counter.counts, f)
                counter = None
            if profiler is not None:
                if args.device == "cuda":
                    torch.cuda.synchronize()
                profiler.stop()
                os.makedirs(args.out_dir, exist_ok=True)
                profiler.export_chrome_trace(os.path.join(args.out_dir, f"profile-step-{step}-rank-{rank}.json"))
                profiler = None
            now = time.perf_counter()
            if metrics:
                record = {"step": step, "loss": loss_sum.item(), "lr": lr,
                          "grad_norm": grad_norm if math.isfinite(grad_norm) else None,
                          "tokens_per_s": step_tokens / (now - step_begin), "elapsed_s": now - begin,
                          "tokens": step * step_tokens}
                if scaler:
                    record["loss_scale"] = scale
                if not math.isfinite(grad_norm):
                    record["skipped"] = True
                metrics.write(json.dumps(record) + "\n")
                metrics.flush()
        if metrics:
            metrics.close()
    finally:
        dist.destroy_process_group()
