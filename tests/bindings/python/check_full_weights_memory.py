"""run.full_weights holds one unit's weights at a time: measured, not assumed.

A Llama of 32 layers with a large vocabulary, initialised fresh in float32, is handed out in
bfloat16 to a consumer that reads each tensor and drops it, as an inference engine's
load_weights copies it. The process's peak resident memory while iterating (VmHWM, reset just
before) rises by at most twice the largest unit gathered in float32, plus 4 MiB: a unit's
gather and its bfloat16 copy, while the consumer's loop variable still holds the last tensor
of the unit before (at most half a unit more). The whole model in bfloat16, which a
generator holding every unit would keep, is well above that. ctest runs it with
MALLOC_MMAP_THRESHOLD_ low, so that freed tensors leave the resident set at once and it
counts live memory, not what the allocator kept from the pass that sized the units.

usage: check_full_weights_memory.py WORK_DIR
"""
import json
import os
import sys

import torch

import fsdpp

LAYERS, HIDDEN, FFN, VOCAB = 32, 256, 1024, 8192
SLACK = 4 << 20


def resident_bytes(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def main():
    work = sys.argv[1]
    os.makedirs(work, exist_ok=True)
    with open(os.path.join(work, "config.json"), "w") as f:
        json.dump({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HIDDEN,
                   "intermediate_size": FFN, "num_hidden_layers": LAYERS, "num_attention_heads": 4,
                   "num_key_value_heads": 4, "vocab_size": VOCAB, "max_position_embeddings": 64,
                   "rms_norm_eps": 1e-6, "tie_word_embeddings": False}, f)
    with open(os.path.join(work, "run.toml"), "w") as f:
        f.write(f'[model]\npath = "{work}/config.json"\n[train]\nthreads = 1\nout_dir = "{work}/out"\n'
                'reuse_out_dir = true\n')
    run = fsdpp.Run(os.path.join(work, "run.toml"))
    # The units' sizes in float32 from one pass, then the measured pass.
    unit_bytes, whole_bf16 = {}, 0
    for unit in range(run._run.units):
        weights = run._run.full_weights(unit, "float32")
        unit_bytes[unit] = sum(t.numel() * 4 for _, t in weights)
        whole_bf16 += sum(t.numel() * 2 for _, t in weights)
        del weights
    largest = max(unit_bytes.values())
    bound = 2 * largest + SLACK
    open("/proc/self/clear_refs", "w").write("5")  # VmHWM from now on
    before = resident_bytes("VmRSS")
    served = {}
    for name, t in run.full_weights(dtype=torch.bfloat16):
        served[name] = t.sum(dtype=torch.float32).item()  # the consumer reads it, then drops it
    rise = resident_bytes("VmHWM") - before
    ok = rise <= bound and rise < whole_bf16 and len(served) == 9 * LAYERS + 3
    print(f"{'ok  ' if ok else 'FAIL'} full_weights in bfloat16: peak resident memory rose {rise / 2**20:.1f} MiB "
          f"while handing out {len(served)} tensors ({whole_bf16 / 2**20:.1f} MiB in all); bound {bound / 2**20:.1f} "
          f"MiB: twice the largest of {len(unit_bytes)} units, {largest / 2**20:.1f} MiB gathered in float32, and "
          f"4 MiB")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
