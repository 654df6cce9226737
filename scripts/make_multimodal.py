#!/usr/bin/env python3
"""Prepares a multimodal dataset for fsdpp (engine/data/multimodal_data.h) from image files,
with the Hugging Face Qwen2-VL image and video processors: samples.jsonl plus pixels.safetensors.

Usage: .venv/bin/python scripts/make_multimodal.py --model MODEL_DIR --out DIR MANIFEST.jsonl

Each MANIFEST line is one sample: {"text": "...", "images": ["a.png", ...], "videos":
[["frame0.png", "frame1.png", ...], ...], "fps": 2.0}. In the text, every "<image>" and
"<video>" marks where the next image or video goes; a line without them is a text-only
sample. Text is tokenized byte by byte (UTF-8), or with --tokenizer tokenizer.json. Each
image or video becomes vision_start, one placeholder per merged patch group, vision_end,
with the token ids, patch size and merge size read from MODEL_DIR/config.json. Relative
file names resolve against the manifest's directory."""
import argparse
import json
import os
import sys

import numpy as np
import torch
from safetensors.torch import save_file


def fail(msg):
    print(f"make_multimodal: {msg}", file=sys.stderr)
    sys.exit(2)


def load_frame(path):
    from PIL import Image
    try:
        with Image.open(path) as image:
            return np.array(image.convert("RGB"))  # writable: torch warns of a read-only array
    except OSError as e:
        fail(f"{path}: cannot read the image ({e})")


def check_sample(where, spec):
    """(text, images, videos, fps) of one manifest line, refused unless each is of its kind."""
    if not isinstance(spec, dict):
        fail(f"{where}: not a JSON object (a sample is {{\"text\": ..., \"images\": [...], ...}})")
    text, images, videos = spec.get("text", ""), spec.get("images", []), spec.get("videos", [])
    fps = spec.get("fps", 2.0)
    if not isinstance(text, str):
        fail(f"{where}: \"text\" is not a string")
    if "\0" in text:  # the marks are cut out on NUL characters
        fail(f"{where}: \"text\" holds a NUL character")
    if not isinstance(images, list) or not all(isinstance(p, str) for p in images):
        fail(f"{where}: \"images\" is not a list of file names")
    if not isinstance(videos, list) or not all(
            isinstance(v, list) and v and all(isinstance(p, str) for p in v) for v in videos):
        fail(f"{where}: \"videos\" is not a list of non-empty lists of frame file names")
    if isinstance(fps, bool) or not isinstance(fps, (int, float)) or not 0 < fps < float("inf"):
        fail(f"{where}: \"fps\" is {json.dumps(fps)}, not a positive number")
    return text, list(images), list(videos), float(fps)


def process(where, name, processor, **kwargs):
    """The processor's output, its refusal (an aspect ratio it does not take) the user's."""
    try:
        return processor(**kwargs)
    except ValueError as e:
        fail(f"{where}: {name}: the processor refuses it ({(str(e).splitlines() or ['ValueError'])[0]})")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("manifest")
    ap.add_argument("--model", required=True, help="HF model directory (or config.json) of the VL model")
    ap.add_argument("--out", required=True, help="dataset directory to write")
    ap.add_argument("--tokenizer", help="tokenizer.json (default: UTF-8 bytes)")
    ap.add_argument("--min-pixels", type=int, default=64 * 64)
    ap.add_argument("--max-pixels", type=int, default=128 * 128)
    args = ap.parse_args()

    from transformers import Qwen2VLImageProcessor, Qwen2VLVideoProcessor
    config_path = args.model if args.model.endswith(".json") else os.path.join(args.model, "config.json")
    try:
        with open(config_path) as f:
            config = json.load(f)
    except OSError as e:
        fail(f"--model {args.model}: cannot read {config_path} ({e.strerror})")
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        fail(f"--model {args.model}: {config_path} is not JSON ({e})")
    keys = ("vision_config", "image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
    if not isinstance(config, dict) or not all(k in config for k in keys):
        fail(f"--model {args.model}: {config_path} is no Qwen2-VL config (it needs {', '.join(keys)})")
    vision = config["vision_config"]
    merge, patch, frames = vision.get("spatial_merge_size", 2), vision.get("patch_size", 14), vision.get("temporal_patch_size", 2)
    sizes = dict(patch_size=patch, temporal_patch_size=frames, merge_size=merge, min_pixels=args.min_pixels,
                 max_pixels=args.max_pixels)
    processor = Qwen2VLImageProcessor(**sizes)
    video_processor = Qwen2VLVideoProcessor(**sizes, do_sample_frames=False)  # every frame the manifest lists
    encode = lambda text: list(text.encode("utf-8"))  # noqa: E731
    if args.tokenizer:
        from tokenizers import Tokenizer
        tokenizer = Tokenizer.from_file(args.tokenizer)
        encode = lambda text: tokenizer.encode(text, add_special_tokens=False).ids  # noqa: E731
    base = os.path.dirname(os.path.abspath(args.manifest))
    pixels, samples = {}, []
    try:
        with open(args.manifest, encoding="utf-8") as f:
            lines = f.readlines()
    except OSError as e:
        fail(f"cannot read {args.manifest}: {e.strerror}")
    except UnicodeDecodeError as e:
        fail(f"{args.manifest} is not valid UTF-8 ({e.reason} at byte {e.start})")
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{args.manifest}:{number}"
        try:
            spec = json.loads(line)
        except json.JSONDecodeError as e:
            fail(f"{where}: not JSON ({e})")
        text, images, videos, fps = check_sample(where, spec)
        if text.count("<image>") != len(images) or text.count("<video>") != len(videos):
            fail(f"{where}: {text.count('<image>')} <image> and {text.count('<video>')} <video> marks for "
                 f"{len(images)} images and {len(videos)} videos")
        sample = {"input_ids": [], "images": [], "videos": []}
        pieces = text.replace("<video>", "\0v\0").replace("<image>", "\0i\0").split("\0")
        for piece in pieces:
            if piece not in ("i", "v"):
                sample["input_ids"] += encode(piece)
                continue
            key = f"s{len(samples)}.{piece}{len(sample['images' if piece == 'i' else 'videos'])}"
            if piece == "i":
                name = images.pop(0)
                # PIL's frames are height x width x RGB; left to guess, the processor takes
                # an image 1, 3 or 4 pixels high or wide for channels first.
                out = process(where, name, processor, images=[load_frame(os.path.join(base, name))],
                              return_tensors="pt", input_data_format="channels_last")
                patches, grid, token = out["pixel_values"], out["image_grid_thw"][0], config["image_token_id"]
                sample["images"].append({"pixels": key, "grid": grid.tolist()})
            else:
                names = videos.pop(0)
                clip = [load_frame(os.path.join(base, p)) for p in names]
                if len({frame.shape for frame in clip}) > 1:
                    fail(f"{where}: the frames of video {names[0]} ... differ in size "
                         f"({', '.join(sorted({f'{f.shape[1]}x{f.shape[0]}' for f in clip}))}); "
                         "a video's frames must all be one size")
                out = process(where, names[0], video_processor, videos=[clip], return_tensors="pt",
                              input_data_format="channels_last")
                patches, grid, token = out["pixel_values_videos"], out["video_grid_thw"][0], config["video_token_id"]
                sample["videos"].append({"pixels": key, "grid": grid.tolist(),
                                         "seconds_per_grid": frames / fps})
            pixels[key] = torch.as_tensor(patches, dtype=torch.float32).contiguous()
            count = int(grid.prod()) // (merge * merge)
            sample["input_ids"] += [config["vision_start_token_id"]] + [token] * count + [config["vision_end_token_id"]]
        samples.append({k: v for k, v in sample.items() if v})
    if not samples:
        fail(f"{args.manifest}: no samples (an empty manifest)")
    os.makedirs(args.out, exist_ok=True)
    save_file(pixels, os.path.join(args.out, "pixels.safetensors"))
    with open(os.path.join(args.out, "samples.jsonl"), "w") as f:
        for sample in samples:
            f.write(json.dumps(sample) + "\n")
    longest = max(len(s["input_ids"]) for s in samples)
    print(f"make_multimodal: {len(samples)} samples ({sum(bool(s.get('images') or s.get('videos')) for s in samples)} "
          f"with images or video), {len(pixels)} pixel tensors, longest sample {longest} tokens -> {args.out}")


if __name__ == "__main__":
    main()
