#!/usr/bin/env python3
"""Prepares a multimodal dataset for fsdpp (engine/data/multimodal_data.h) from image files,
with the Hugging Face Qwen2-VL image and video processors: samples.jsonl plus pixels.safetensors.

Usage: .venv/bin/python scripts/make_multimodal.py --model MODEL_DIR --out DIR MANIFEST.jsonl

Each MANIFEST line is one sample: {"text": "...", "images": ["a.png", ...], "videos":
[["frame0.png", "frame1.png", ...], ...], "fps": 2.0}. In the text, every "<image>" and
"<video>" marks where the next image or video goes; a line without them is a text-only
sample. A line may give "prompt" and "completion" in place of "text" (marks in either): the
sample is the two in turn, and its "prompt_length" in samples.jsonl counts the prompt's
tokens, which [data] train_on = "completion" does not learn; nothing is added to the
completion, so it ends with the model's end-of-turn token where the model should learn to
stop (for Qwen2-VL, "<|im_end|>"). Text is tokenized by --tokenizer (a tokenizer.json or its directory), else by
MODEL_DIR/tokenizer.json where the model has one, else byte by byte (UTF-8: the byte-level
tiny models alone). Each image or video becomes vision_start, one placeholder per merged
patch group, vision_end, with the token ids, patch size and merge size read from
MODEL_DIR/config.json; images are resized between --min-pixels and --max-pixels, by default
MODEL_DIR/preprocessor_config.json's bounds where it has them, as the model's processor would
resize them, else 64x64 and 128x128. Relative file names resolve against the manifest's
directory. Nothing is written unless every sample is good."""
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


def load_frame(where, path):
    from PIL import Image
    try:
        with Image.open(path) as image:
            return np.array(image.convert("RGB"))  # writable: torch warns of a read-only array
    except (OSError, Image.DecompressionBombError) as e:
        fail(f"{where}: {path}: cannot read the image ({e})")


def check_text(where, key, text):
    if not isinstance(text, str):
        fail(f"{where}: \"{key}\" is not a string")
    if "\0" in text:  # the marks are cut out on NUL characters
        fail(f"{where}: \"{key}\" holds a NUL character")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        fail(f"{where}: \"{key}\" holds {e.object[e.start:e.end]!r}, which no UTF-8 text holds (a lone surrogate)")


def check_sample(where, spec):
    """(texts, images, videos, fps) of one manifest line, refused unless each is of its kind:
    texts maps "text", or "prompt" and "completion", to their strings."""
    if not isinstance(spec, dict):
        fail(f"{where}: not a JSON object (a sample is {{\"text\": ..., \"images\": [...], ...}})")
    if "prompt" in spec or "completion" in spec:
        if "text" in spec:
            fail(f"{where}: \"text\" beside \"prompt\" and \"completion\"; a sample has one or the other")
        missing = "completion" if "prompt" in spec else "prompt"
        if missing not in spec:
            fail(f"{where}: \"{'prompt' if missing == 'completion' else 'completion'}\" without \"{missing}\"")
        texts = {"prompt": spec["prompt"], "completion": spec["completion"]}
    else:
        texts = {"text": spec.get("text", "")}
    for key, text in texts.items():
        check_text(where, key, text)
    images, videos, fps = spec.get("images", []), spec.get("videos", []), spec.get("fps", 2.0)
    if not isinstance(images, list) or not all(isinstance(p, str) for p in images):
        fail(f"{where}: \"images\" is not a list of file names")
    if not isinstance(videos, list) or not all(
            isinstance(v, list) and v and all(isinstance(p, str) for p in v) for v in videos):
        fail(f"{where}: \"videos\" is not a list of non-empty lists of frame file names")
    if isinstance(fps, bool) or not isinstance(fps, (int, float)) or not 0 < fps < float("inf"):
        fail(f"{where}: \"fps\" is {json.dumps(fps)}, not a positive number")
    return texts, list(images), list(videos), float(fps)


def pixel_bounds(args, model_dir):
    """(min_pixels, max_pixels): the flags, else the model's preprocessor_config.json (either
    spelling: min_pixels/max_pixels, or size's shortest_edge/longest_edge), else 64x64 and 128x128."""
    found = {}
    path = os.path.join(model_dir, "preprocessor_config.json")
    if os.path.exists(path):
        try:
            with open(path) as f:
                pre = json.load(f)
        except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
            fail(f"{path}: cannot be read as JSON ({e})")
        size = pre.get("size") if isinstance(pre, dict) and isinstance(pre.get("size"), dict) else {}
        found = {"min": pre.get("min_pixels", size.get("shortest_edge")), "max": pre.get("max_pixels", size.get("longest_edge"))}
    bounds = []
    for flag, key, default in ((args.min_pixels, "min", 64 * 64), (args.max_pixels, "max", 128 * 128)):
        value = flag if flag is not None else found.get(key) if found.get(key) is not None else default
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            fail(f"{key}_pixels {value!r} (from {'--' + key + '-pixels' if flag is not None else path}) is not a whole number >= 1")
        bounds.append(value)
    if bounds[0] > bounds[1]:
        fail(f"min_pixels {bounds[0]} is above max_pixels {bounds[1]}")
    return bounds


def text_encoder(tokenizer_arg, model_dir):
    """(encode, what it is): --tokenizer's (a tokenizer.json or its directory), else the model's
    tokenizer.json, else UTF-8 bytes."""
    path = tokenizer_arg
    if path is not None and os.path.isdir(path):
        path = os.path.join(path, "tokenizer.json")
    if path is None and os.path.exists(os.path.join(model_dir, "tokenizer.json")):
        path = os.path.join(model_dir, "tokenizer.json")
    if path is None:
        return (lambda text: list(text.encode("utf-8"))), "UTF-8 bytes"
    from tokenizers import Tokenizer
    try:
        tokenizer = Tokenizer.from_file(path)
    except Exception as e:  # the tokenizers library raises its own Exception for any file it cannot take
        fail(f"--tokenizer {path}: cannot be read as a tokenizer.json ({e})")
    return (lambda text: tokenizer.encode(text, add_special_tokens=False).ids), path


def process(where, name, processor, **kwargs):
    """The processor's output, its refusal (an aspect ratio it does not take) the user's."""
    try:
        return processor(**kwargs)
    except ValueError as e:
        fail(f"{where}: {name}: the processor refuses it ({(str(e).splitlines() or ['ValueError'])[0]})")


def read_model_config(model):
    """(config, its path): the model's config.json, refused unless it is a Qwen2-VL's."""
    path = model if model.endswith(".json") else os.path.join(model, "config.json")
    try:
        with open(path) as f:
            config = json.load(f)
    except OSError as e:
        fail(f"--model {model}: cannot read {path} ({e.strerror})")
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        fail(f"--model {model}: {path} is not JSON ({e})")
    keys = ("vision_config", "image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
    if not isinstance(config, dict) or not all(k in config for k in keys):
        fail(f"--model {model}: {path} is no Qwen2-VL config (it needs {', '.join(keys)})")
    return config, path


def read_manifest_lines(path):
    """(line number, text) of each non-blank line of the manifest."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        fail(f"cannot read {path}: {e.strerror}")
    try:
        lines = raw.decode("utf-8").split("\n")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        fail(f"{path}:{line}: not valid UTF-8 ({e.reason} at byte {e.start})")
    return [(number, line) for number, line in enumerate(lines, 1) if line.strip()]


class SampleEncoder:
    """A manifest line's texts, images and videos as one sample of samples.jsonl; the patches
    gather in `pixels`, by the keys the samples name."""

    def __init__(self, config, encode, sizes, base):
        from transformers import Qwen2VLImageProcessor, Qwen2VLVideoProcessor
        self.config, self.encode_text, self.base = config, encode, base
        self.merge, self.frames = sizes["merge_size"], sizes["temporal_patch_size"]
        self.processor = Qwen2VLImageProcessor(**sizes)
        self.video_processor = Qwen2VLVideoProcessor(**sizes, do_sample_frames=False)  # every frame listed
        self.pixels = {}

    def image(self, where, name):
        """(patches, grid, placeholder token) of one picture."""
        # PIL's frames are height x width x RGB; left to guess, the processor takes an image
        # 1, 3 or 4 pixels high or wide for channels first.
        out = process(where, name, self.processor, images=[load_frame(where, os.path.join(self.base, name))],
                      return_tensors="pt", input_data_format="channels_last")
        return out["pixel_values"], out["image_grid_thw"][0], self.config["image_token_id"]

    def video(self, where, names):
        clip = [load_frame(where, os.path.join(self.base, p)) for p in names]
        if len({frame.shape for frame in clip}) > 1:
            fail(f"{where}: the frames of video {names[0]} ... differ in size "
                 f"({', '.join(sorted({f'{f.shape[1]}x{f.shape[0]}' for f in clip}))}); "
                 "a video's frames must all be one size")
        out = process(where, names[0], self.video_processor, videos=[clip], return_tensors="pt",
                      input_data_format="channels_last")
        return out["pixel_values_videos"], out["video_grid_thw"][0], self.config["video_token_id"]

    def sample(self, where, index, texts, images, videos, fps):
        marks = [text.count("<image>") for text in texts.values()], [text.count("<video>") for text in texts.values()]
        if sum(marks[0]) != len(images) or sum(marks[1]) != len(videos):
            fail(f"{where}: {sum(marks[0])} <image> and {sum(marks[1])} <video> marks for "
                 f"{len(images)} images and {len(videos)} videos")
        sample = {"input_ids": [], "images": [], "videos": []}
        for key, text in texts.items():
            for piece in text.replace("<video>", "\0v\0").replace("<image>", "\0i\0").split("\0"):
                if piece not in ("i", "v"):
                    sample["input_ids"] += self.encode_text(piece)
                    continue
                kind = "images" if piece == "i" else "videos"
                name = f"s{index}.{piece}{len(sample[kind])}"
                if piece == "i":
                    patches, grid, token = self.image(where, images.pop(0))
                    sample["images"].append({"pixels": name, "grid": grid.tolist()})
                else:
                    patches, grid, token = self.video(where, videos.pop(0))
                    sample["videos"].append({"pixels": name, "grid": grid.tolist(), "seconds_per_grid": self.frames / fps})
                self.pixels[name] = torch.as_tensor(patches, dtype=torch.float32).contiguous()
                count = int(grid.prod()) // (self.merge * self.merge)
                sample["input_ids"] += ([self.config["vision_start_token_id"]] + [token] * count +
                                        [self.config["vision_end_token_id"]])
            if key == "prompt":
                sample["prompt_length"] = len(sample["input_ids"])
        if len(sample["input_ids"]) < 2:
            fail(f"{where}: {len(sample['input_ids'])} tokens; a sample needs 2 or more (a token and the one it predicts)")
        if len(sample["input_ids"]) == sample.get("prompt_length"):
            fail(f"{where}: \"completion\" gives no tokens; a sample learns its completion")
        return {k: v for k, v in sample.items() if v or k == "prompt_length"}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("manifest")
    ap.add_argument("--model", required=True, help="HF model directory (or config.json) of the VL model")
    ap.add_argument("--out", required=True, help="dataset directory to write")
    ap.add_argument("--tokenizer", help="tokenizer.json or its directory (default: the model's, else UTF-8 bytes)")
    ap.add_argument("--min-pixels", type=int, help="default: the model's preprocessor_config.json, else 64x64")
    ap.add_argument("--max-pixels", type=int, help="default: the model's preprocessor_config.json, else 128x128")
    args = ap.parse_args()
    if os.path.isfile(args.out):
        fail(f"--out {args.out}: a file, not a directory to write")

    config, config_path = read_model_config(args.model)
    vision = config["vision_config"]
    model_dir = os.path.dirname(config_path) or "."
    min_pixels, max_pixels = pixel_bounds(args, model_dir)
    sizes = dict(patch_size=vision.get("patch_size", 14), temporal_patch_size=vision.get("temporal_patch_size", 2),
                 merge_size=vision.get("spatial_merge_size", 2), min_pixels=min_pixels, max_pixels=max_pixels)
    encode, tokenized_by = text_encoder(args.tokenizer, model_dir)
    encoder = SampleEncoder(config, encode, sizes, os.path.dirname(os.path.abspath(args.manifest)))
    samples = []
    for number, line in read_manifest_lines(args.manifest):
        where = f"{args.manifest}:{number}"
        try:
            spec = json.loads(line)
        except json.JSONDecodeError as e:
            fail(f"{where}: not JSON ({e})")
        samples.append(encoder.sample(where, len(samples), *check_sample(where, spec)))
    if not samples:
        fail(f"{args.manifest}: no samples (an empty manifest)")
    try:
        os.makedirs(args.out, exist_ok=True)
        save_file(encoder.pixels, os.path.join(args.out, "pixels.safetensors"))
        with open(os.path.join(args.out, "samples.jsonl"), "w") as f:
            for sample in samples:
                f.write(json.dumps(sample) + "\n")
    except OSError as e:
        fail(f"--out {args.out}: cannot write the dataset ({e.strerror}: {e.filename})")
    longest = max(len(s["input_ids"]) for s in samples)
    prompted = sum("prompt_length" in s for s in samples)
    print(f"make_multimodal: {len(samples)} samples ({sum(bool(s.get('images') or s.get('videos')) for s in samples)} "
          f"with images or video, {prompted} with a prompt), {len(encoder.pixels)} pixel tensors, longest sample "
          f"{longest} tokens, text tokenized by {tokenized_by}, images of {min_pixels} to {max_pixels} pixels -> {args.out}")


if __name__ == "__main__":
    main()
