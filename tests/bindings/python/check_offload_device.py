"""offload() and reload() on the device the run trains on, with a model of real size.

A 1.1B Llama (examples/models/llama-1b, fresh) with float32 masters and bfloat16 compute
takes a step, so gradients and AdamW's state exist, then a backward whose gradients are held;
then offload() of everything:
- on a GPU, the device memory the caching allocator holds (torch.cuda.memory_reserved) falls
  under 5% of what it was, or under 1 GiB, and the driver's count of used memory falls by
  about as much; the seconds offload and reload take are printed;
- reload(), then the step: the step's figures and every weight bitwise those of the same
  calls with no offload between;
- full_weights in bfloat16 raises the allocator's peak by at most the largest unit gathered
  in float32 plus its bfloat16 copy, and 64 MiB;
- the decoder's q and k, laid out as its projections leave them, take the fused RoPE kernel
  on the GPU: the first step's autograd graph holds it on every layer and no `flip` of the
  composed fallback (counted on the CPU too, where the fallback is the path); and each
  layer's first residual add and RMSNorm run as one fused kernel (none on the CPU).
Without a GPU it runs the same calls on the CPU with examples/models/tiny-llama (the memory
figures are then the host's and are not judged).

usage: check_offload_device.py WORK_DIR   (scripts/gpu_check.sh python runs it on a GPU)
"""
import json
import os
import sys
import time

import torch

import fsdpp

GIB = 1 << 30


def model_dir(cuda):
    return "examples/models/llama-1b" if cuda else "examples/models/tiny-llama"


def run_file(work, cuda):
    model = model_dir(cuda)
    path = os.path.join(work, "run.toml")
    with open(path, "w") as f:
        f.write(f'[model]\npath = "{os.path.abspath(model)}"\ninit_seed = 1\n[optimizer]\nlr = 1e-4\n'
                f'[train]\nout_dir = "{work}/out"\nreuse_out_dir = true\nthreads = {0 if cuda else 1}\n'
                f'[parallel]\ndevice = "{"cuda" if cuda else "cpu"}"\n'
                '[policy.options]\nparam_dtype = "bfloat16"\n')
    return path


def autograd_nodes(t):
    """The names of every node of t's autograd graph."""
    seen, pending, names = set(), [t.grad_fn], []
    while pending:
        node = pending.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.append(node.name())
        pending.extend(next_node for next_node, _ in node.next_functions)
    return names


def train(path, ids, offload_between):
    """Two steps, the second's gradients held across an offload when asked: the figures, the
    weights after, and the measurements (memory; the first step's RoPE nodes)."""
    run = fsdpp.Run(path)
    figures, measured = [], {}
    for step in range(2):
        logits = run.model(ids[:, :-1])
        if step == 0:
            names = autograd_nodes(logits)
            measured["fused_rotary"] = sum("FusedRotary" in n for n in names)
            measured["flips"] = sum(n.startswith("FlipBackward") for n in names)
            measured["fused_norms"] = sum("FusedAddRMSNorm" in n for n in names)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten().to(logits.device))
        loss.backward()
        del logits
        if offload_between and step == 1:
            measured.update(offload_round_trip(run))
        figures.append((loss.item(),) + run.step())
        run.zero_grad()
    if offload_between:
        measured["full_weights_peak"], measured["largest_unit"] = full_weights_peak(run)
    weights = {name: t.cpu() for name, t in run.full_weights(dtype=torch.float32)}
    return figures, weights, measured


def device_use():
    if not torch.cuda.is_available():
        return 0, 0
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return torch.cuda.memory_reserved(), total - free


def offload_round_trip(run):
    before = device_use()
    start = time.perf_counter()
    run.offload()
    offload_s = time.perf_counter() - start
    after = device_use()
    start = time.perf_counter()
    run.reload()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return {"before": before, "after": after, "offload_s": offload_s, "reload_s": time.perf_counter() - start}


def full_weights_peak(run):
    largest = max(sum(t.numel() * 4 for _, t in run._run.full_weights(u, "float32")) for u in range(run._run.units))
    if not torch.cuda.is_available():
        return 0, largest
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    for _, t in run.full_weights(dtype=torch.bfloat16):
        t.float().sum().item()
    return torch.cuda.max_memory_allocated() - base, largest


def main():
    work = sys.argv[1]
    os.makedirs(work, exist_ok=True)
    cuda = torch.cuda.is_available()
    path = run_file(work, cuda)
    vocab = 32000 if cuda else 256
    ids = torch.randint(vocab, (4, 1025 if cuda else 33), generator=torch.Generator().manual_seed(0))
    plain, plain_weights, _ = train(path, ids, False)
    if cuda:
        torch.cuda.empty_cache()
    moved, moved_weights, m = train(path, ids, True)
    same = plain == moved and all(torch.equal(plain_weights[k], moved_weights[k]) for k in plain_weights)
    print(f"{'ok  ' if same else 'FAIL'} offload of everything between backward and step, then reload: the step "
          f"and {len(plain_weights)} weights {'bitwise' if same else 'NOT'} as with no offload; offload "
          f"{m['offload_s']:.2f} s, reload {m['reload_s']:.2f} s")
    ok = same
    layers = json.load(open(os.path.join(model_dir(cuda), "config.json")))["num_hidden_layers"]
    fused = m["fused_rotary"] == 2 * layers and m["flips"] == 0
    ok &= fused or not cuda
    print(f"{'ok  ' if fused or not cuda else 'FAIL'} RoPE: {m['fused_rotary']} fused rotations and {m['flips']} flips "
          f"in the first step's graph ({'on the GPU: q and k of ' + str(layers) + ' layers fused' if cuda else 'on the CPU: the composed path'})")
    # Each layer's first residual add and the RMSNorm after it: one fused kernel on the GPU.
    norms = m["fused_norms"] == (layers if cuda else 0)
    ok &= norms
    print(f"{'ok  ' if norms else 'FAIL'} residual RMSNorm: {m['fused_norms']} fused in the first step's graph "
          f"(expected {layers if cuda else 0}: {'one per layer' if cuda else 'none on the CPU'})")
    if cuda:
        (reserved0, used0), (reserved1, used1) = m["before"], m["after"]
        fell = reserved1 < 0.05 * reserved0 or reserved1 < GIB
        ok &= fell
        print(f"{'ok  ' if fell else 'FAIL'} device memory held by the allocator {reserved0 / GIB:.2f} GiB -> "
              f"{reserved1 / GIB:.2f} GiB after offload ({100 * reserved1 / max(reserved0, 1):.1f}%; bound 5% or "
              f"1 GiB); the driver's used memory {used0 / GIB:.2f} -> {used1 / GIB:.2f} GiB")
        bound = m["largest_unit"] * 3 // 2 + (64 << 20)
        bounded = m["full_weights_peak"] <= bound
        ok &= bounded
        print(f"{'ok  ' if bounded else 'FAIL'} full_weights in bfloat16: allocator peak rose "
              f"{m['full_weights_peak'] / 2**20:.0f} MiB; bound {bound / 2**20:.0f} MiB (largest unit "
              f"{m['largest_unit'] / 2**20:.0f} MiB in float32, its copy, 64 MiB)")
    else:
        print("no GPU: the device-memory figures are a GPU's and were not measured")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
