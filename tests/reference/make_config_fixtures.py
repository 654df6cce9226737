# Writes each config.json of tests/assets/configs as transformers reads it and saves it again,
# for the C++ test that both read to the same model:
#   transformers4/  files as transformers 4.57.1 saved them (num_experts, rope_theta beside
#                   rope_scaling, ...), which transformers 5 saves under its own names
#                   (num_local_experts, rope_parameters, ...);
#   minimal/        the required keys alone, which transformers saves with every default filled.
# OUTDIR/configs/<kind>/<family>/ gets original.json (the asset) and config.json (the save).
# Run with the project venv: .venv/bin/python tests/reference/make_config_fixtures.py OUTDIR
import argparse
import os
import shutil
import sys

from transformers import AutoConfig

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
    print(f"{written} configs saved again by transformers into {outdir}/configs")


if __name__ == "__main__":
    main()
