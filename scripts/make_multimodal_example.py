#!/usr/bin/env python3
"""Builds the multimodal example's data: small pictures of coloured shapes and two short
clips of a moving square (drawn here, so no download is needed), a manifest captioning
them, with text-only samples mixed in, then the dataset itself through
scripts/make_multimodal.py. Writes data/multimodal-example/ (or --out);
idempotent."""
import argparse
import json
import os
import subprocess
import sys

from PIL import Image, ImageDraw

OUT = "data/multimodal-example"
MODEL = "examples/models/tiny-qwen2-vl"
COLOURS = {"red": (220, 40, 40), "green": (40, 180, 60), "blue": (50, 80, 220), "yellow": (230, 210, 40)}
SHAPES = ("square", "circle")


def draw(path, colour, shape, offset=0):
    image = Image.new("RGB", (48, 48), (245, 245, 245))
    box = (8 + offset, 12, 32 + offset, 36)
    pen = ImageDraw.Draw(image)
    (pen.rectangle if shape == "square" else pen.ellipse)(box, fill=COLOURS[colour])
    image.save(path)


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=OUT, metavar="DIR",
                    help=f"directory of the pictures, the manifest and dataset/ (default: {OUT})")
    ap.add_argument("--model", default=MODEL, metavar="DIR",
                    help=f"the VL model whose config.json sizes the patches (default: {MODEL})")
    args = ap.parse_args()
    make(args.out, args.model)


def make(out, model):
    os.makedirs(os.path.join(out, "images"), exist_ok=True)
    lines = []
    for colour in COLOURS:
        for shape in SHAPES:
            name = f"images/{colour}-{shape}.png"
            draw(os.path.join(out, name), colour, shape)
            lines.append({"text": f"<image>This is a {colour} {shape}.", "images": [name]})
            lines.append({"text": f"A {colour} {shape} looks like this: <image>", "images": [name]})
    for colour in ("red", "blue"):
        frames = []
        for step in range(4):
            name = f"images/{colour}-moving-{step}.png"
            draw(os.path.join(out, name), colour, "square", offset=4 * step)
            frames.append(name)
        lines.append({"text": f"<video>A {colour} square moves to the right.", "videos": [frames], "fps": 2.0})
    lines += [{"text": f"The {c} {s} and the {d} {t} are different shapes."}
              for c, d in (("red", "blue"), ("green", "yellow")) for s, t in (("square", "circle"), ("circle", "square"))]
    manifest = os.path.join(out, "manifest.jsonl")
    with open(manifest, "w") as f:
        for line in lines:
            f.write(json.dumps(line) + "\n")
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "make_multimodal.py")
    made = subprocess.run([sys.executable, script, "--model", model, "--out", os.path.join(out, "dataset"), manifest])
    if made.returncode:  # make_multimodal.py said why on its one line
        sys.exit(made.returncode)


if __name__ == "__main__":
    main()
