"""The real-shape run files of the GPU benchmark plan as they stand, and fsdpp builds each
model with the parameter count transformers builds from the same config.json (on the meta
device: no memory); the LoRA shape adds rank × (inputs + outputs) for every targeted
projection, as peft does.

usage: check_model_shapes.py FSDPP
"""
import re
import subprocess
import sys

import torch
from transformers import AutoConfig, AutoModelForCausalLM

SHAPES = ["llama-3.2-1b", "llama-3.2-3b", "qwen3-4b", "qwen3-30b-a3b-4l", "qwen3-8b"]


def transformers_count(name, plan):
    config = AutoConfig.from_pretrained(f"examples/models/{name}")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    count = sum(p.numel() for p in model.parameters())
    rank = re.search(r"^\s+\* lora_rank = (\d+)", plan, re.M)
    if rank:
        targets = re.search(r'^\s+\* lora_targets = "([^"]+)"', plan, re.M).group(1).split(",")
        for path, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and path.rsplit(".", 1)[-1] in targets:
                count += int(rank.group(1)) * (module.in_features + module.out_features)
    return count


def main():
    fsdpp = sys.argv[1]
    ok = True
    for name in SHAPES:
        result = subprocess.run([fsdpp, "plan", f"examples/{name}-gpu.toml", "--world", "8"], capture_output=True,
                                text=True, timeout=120)
        found = re.search(r"plan for 8 rank\(s\): (\d+) units, (\d+) parameters", result.stdout)
        if result.returncode != 0 or not found:
            print(f"FAIL {name}: does not plan: {result.stderr.strip().splitlines()[-1:]}")
            ok = False
            continue
        want = transformers_count(name, result.stdout)
        good = int(found.group(2)) == want
        ok &= good
        print(f"{'ok  ' if good else 'FAIL'} {name}: {found.group(1)} units, {int(found.group(2)):,} parameters; "
              f"transformers builds {want:,}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
