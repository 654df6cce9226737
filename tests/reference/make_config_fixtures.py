# Writes each config.json of tests/assets/configs as transformers reads it and saves it again,
# for the C++ test that both read to the same model:
#   transformers4/  files as transformers 4.57.1 saved them (num_experts, rope_theta beside
#                   rope_scaling, ...), which transformers 5 saves under its own names
#                   (num_local_experts, rope_parameters, ...);
#   minimal/        the required keys alone, which transformers saves with every default filled.
# OUTDIR/configs/<kind>/<family>/ gets original.json (the asset) and config.json (the save).
# OUTDIR/configs/biased/<family>/ gets each minimal file with attention_bias and mlp_bias set,
# and biases.json: the decoder's bias parameters transformers builds from it, from "layers." on
# (each family's classes honour some of the two switches and ignore the rest).
# Run with the project venv: .venv/bin/python tests/reference/make_config_fixtures.py OUTDIR
import argparse
import json
import os
import shutil
import sys

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

ASSETS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "assets", "configs")


def main():
    ap = argparse.ArgumentParser(description="Each tests/assets/configs file as transformers saves it again.")
    ap.add_argument("outdir", metavar="OUTDIR")
    outdir = ap.parse_args().outdir
    written = 0
    for kind in sorted(os.listdir(ASSETS)):
        for name in sorted(f for f in os.listdir(os.path.join(ASSETS, kind)) if f.endswith(".json")):
            source = os.path.join(ASSETS, kind, name)
            target = os.path.join(outdir, "configs", kind, name.removesuffix(".json"))
            os.makedirs(target, exist_ok=True)
            shutil.copyfile(source, os.path.join(target, "original.json"))
            AutoConfig.from_pretrained(source).save_pretrained(target)
            written += 1
    if written == 0:
        sys.exit(f"make_config_fixtures: no config files under {ASSETS}")
    for name in sorted(f for f in os.listdir(os.path.join(ASSETS, "minimal")) if f.endswith(".json")):
        write_biased(os.path.join(ASSETS, "minimal", name), os.path.join(outdir, "configs", "biased", name.removesuffix(".json")))
    print(f"{written} configs saved again by transformers into {outdir}/configs")


def write_biased(source, target):
    """The file with both bias switches on, and the decoder biases transformers builds from it."""
    with open(source) as f:
        config = json.load(f)
    (config.get("text_config") or config).update(attention_bias=True, mlp_bias=True)
    os.makedirs(target, exist_ok=True)
    path = os.path.join(target, "config.json")
    with open(path, "w") as f:
        json.dump(config, f, indent=2)
    loaded = AutoConfig.from_pretrained(path)
    auto = AutoModelForImageTextToText if "vision_config" in config else AutoModelForCausalLM
    with torch.device("meta"):
        model = auto.from_config(loaded)
    names = sorted(n[n.index("layers."):] for n, _ in model.named_parameters()
                   if n.endswith(".bias") and "layers." in n and "visual" not in n)
    with open(os.path.join(target, "biases.json"), "w") as f:
        json.dump(names, f, indent=1)


if __name__ == "__main__":
    main()
