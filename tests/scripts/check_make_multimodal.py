"""scripts/make_multimodal.py, make_multimodal_example.py and make_tokens.py on what a user can get
wrong: each refusal is exit status 2 and one stderr line naming the file and line (or the
option), never a traceback, and leaves the files it names as they were.

make_tokens.py writes over a token file alone, never over one of its inputs nor a file of the
user's that is no token file. make_multimodal.py reads PIL's frames as channels last: a 1x1 pure
red picture (which the processor, left to guess, takes for channels first) comes out red, its
normalised R channel above zero and G and B below. It refuses a missing manifest or --model, a
line that is no JSON object, a "text" that is no string or holds NUL, an empty manifest, a
picture whose aspect ratio the processor refuses, a video of frames of different sizes, an
"fps" that is no positive number, a sample of fewer than 2 tokens, a lone surrogate, a missing
picture (naming the manifest's line), a "prompt" without its "completion" (or beside "text"),
a completion of no tokens, an --out that is a file and a --tokenizer that is none; it
tokenizes and sizes as a model directory's tokenizer.json and preprocessor_config.json say,
unless the flags say otherwise, and counts a prompt's tokens, its images' included. make_multimodal_example.py answers --help without writing."""
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile

import numpy as np
from PIL import Image
from safetensors.numpy import load_file

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPTS = os.path.join(ROOT, "scripts")
MODEL = os.path.join(ROOT, "examples", "models", "tiny-qwen2-vl")


def run(script, *args):
    return subprocess.run([sys.executable, os.path.join(SCRIPTS, script), *args], capture_output=True, text=True,
                          cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})


def refused(result, name, *needles):
    """Exit status 2 and one stderr line holding every needle."""
    lines = result.stderr.splitlines()
    assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"{name}: ") and all(
        n in lines[0] for n in needles), (result.returncode, result.stderr, needles)
    return lines[0]


def write(work, name, data):
    path = os.path.join(work, name)
    with open(path, "wb") as f:
        f.write(data)
    return path


def picture(work, name, size, colour=(255, 0, 0)):
    path = os.path.join(work, name)
    Image.new("RGB", size, colour).save(path)
    return path


def manifest(work, name, *samples):
    return write(work, name, "".join((s if isinstance(s, str) else json.dumps(s)) + "\n" for s in samples).encode())


def check_make_tokens(work):
    notes = write(work, "notes.txt", b"my notes\n")
    refused(run("make_tokens.py", "--out", notes, notes), "make_tokens", f"--out {notes}: is one of the inputs")
    config = write(work, "config.json", b"{}")
    refused(run("make_tokens.py", "--out", config, notes), "make_tokens",
            f"--out {config}: holds something other than a token file")
    refused(run("make_tokens.py", "--out", work, notes), "make_tokens", f"--out {work}: exists and is not a file")
    assert open(notes, "rb").read() == b"my notes\n" and open(config, "rb").read() == b"{}"
    # Text for a tokenizer must be UTF-8; the refusal names the line (bytes alone take any).
    from tokenizers import Tokenizer, models
    tokenizer = os.path.join(work, "words.json")
    Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]")).save(tokenizer)
    latin = write(work, "latin.txt", b"fine\ncaf\xe9\n")
    refused(run("make_tokens.py", "--tokenizer", tokenizer, "--out", os.path.join(work, "latin.tok"), latin),
            "make_tokens", f"{latin}:2: not valid UTF-8 (invalid continuation byte at byte 8)")
    out = os.path.join(work, "notes.tok")
    for _ in range(2):  # the second over the token file the first wrote
        made = run("make_tokens.py", "--out", out, notes)
        assert made.returncode == 0 and not made.stderr, made.stderr
    with open(out, "rb") as f:
        data = f.read()
    assert data[:8] == b"FSDPTOK\x00" and struct.unpack_from("<IIQQ", data, 8) == (1, 2, 9, 256), data[:32]
    assert data[32:] == struct.pack("<9H", *b"my notes\n")


def check_red_pixel(work):
    """A 1x1 red picture, as the script reads it and as its dataset holds it."""
    from transformers import Qwen2VLImageProcessor
    vision = json.load(open(os.path.join(MODEL, "config.json")))["vision_config"]
    processor = Qwen2VLImageProcessor(patch_size=vision.get("patch_size", 14),
                                      merge_size=vision.get("spatial_merge_size", 2),
                                      temporal_patch_size=vision.get("temporal_patch_size", 2))
    red = np.array(Image.open(picture(work, "red.png", (1, 1))).convert("RGB"))
    out = processor(images=[red], return_tensors="np", input_data_format="channels_last")["pixel_values"]
    channels = out.reshape(out.shape[0], 3, -1).mean(axis=(0, 2))
    assert channels[0] > 0 > max(channels[1], channels[2]), channels

    # Through the script: the image's patches, and the first frame of a 1x4 video's.
    picture(work, "red-1x4-a.png", (4, 1))
    picture(work, "red-1x4-b.png", (4, 1))
    lines = manifest(work, "red.jsonl", {"text": "a <image> red", "images": ["red.png"]},
                     {"text": "<video>", "videos": [["red-1x4-a.png", "red-1x4-b.png"]], "fps": 1})
    made = run("make_multimodal.py", "--model", MODEL, "--out", os.path.join(work, "red"), lines)
    assert made.returncode == 0, made.stderr
    pixels = load_file(os.path.join(work, "red", "pixels.safetensors"))
    assert set(pixels) == {"s0.i0", "s1.v0"}, set(pixels)
    for key, tensor in pixels.items():
        channels = tensor.reshape(tensor.shape[0], 3, -1).mean(axis=(0, 2))
        assert channels[0] > 0 > max(channels[1], channels[2]), (key, channels)


def check_multimodal_refusals(work):
    out = os.path.join(work, "out")
    fine = manifest(work, "fine.jsonl", {"text": "text alone"})
    missing = os.path.join(work, "missing.jsonl")
    refused(run("make_multimodal.py", "--model", MODEL, "--out", out, missing), "make_multimodal",
            f"cannot read {missing}: No such file or directory")
    no_model = os.path.join(work, "no-model")
    refused(run("make_multimodal.py", "--model", no_model, "--out", out, fine), "make_multimodal",
            f"--model {no_model}: cannot read")
    picture(work, "wide.png", (5000, 20))
    picture(work, "small.png", (48, 48))
    picture(work, "large.png", (64, 48))
    cases = [
        ("[1]", "not a JSON object"),
        ({"text": 5}, '"text" is not a string'),
        ({"text": "a\u0000i\u0000b"}, '"text" holds a NUL character'),
        ({"text": "<image>", "images": ["wide.png"]}, "wide.png: the processor refuses it"),
        ({"text": "<video>", "videos": [["small.png", "large.png"]]}, "differ in size"),
        ({"text": "<video>", "videos": [["small.png", "small.png"]], "fps": 0}, '"fps" is 0, not a positive number'),
        ({"text": "<video>", "videos": [["small.png", "small.png"]], "fps": -2}, '"fps" is -2'),
        ({"text": "<video>", "videos": [["small.png", "small.png"]], "fps": "fast"}, '"fps" is "fast"'),
        ({"text": ""}, "0 tokens; a sample needs 2 or more"),
        ({}, "0 tokens; a sample needs 2 or more"),
        ({"text": "a\ud800b"}, "which no UTF-8 text holds (a lone surrogate)"),
        ({"text": "<image>", "images": ["nope.png"]}, "nope.png: cannot read the image"),
        ({"text": "a", "prompt": "b", "completion": "c"}, '"text" beside "prompt" and "completion"'),
        ({"prompt": "ab"}, '"prompt" without "completion"'),
        ({"completion": "ab"}, '"completion" without "prompt"'),
        ({"prompt": 5, "completion": "ab"}, '"prompt" is not a string'),
        ({"prompt": "ab", "completion": ""}, '"completion" gives no tokens'),
        ({"prompt": "<image>", "completion": "<image>", "images": ["small.png"]}, "2 <image> and 0 <video> marks for 1"),
    ]
    for k, (sample, reason) in enumerate(cases):
        lines = manifest(work, f"bad-{k}.jsonl", {"text": "first line fine"}, "", sample)
        refused(run("make_multimodal.py", "--model", MODEL, "--out", out, lines), "make_multimodal",
                f"{lines}:3: ", reason)
    invalid = write(work, "invalid.jsonl", b'{"text": "fine"}\n{"text": "bad \xff"}\n')
    refused(run("make_multimodal.py", "--model", MODEL, "--out", out, invalid), "make_multimodal",
            f"{invalid}:2: not valid UTF-8 (invalid start byte at byte 31)")
    refused(run("make_multimodal.py", "--model", MODEL, "--out", fine, fine), "make_multimodal",
            f"--out {fine}: a file, not a directory to write")
    refused(run("make_multimodal.py", "--model", MODEL, "--tokenizer", work, "--out", out, fine), "make_multimodal",
            f"--tokenizer {os.path.join(work, 'tokenizer.json')}: cannot be read as a tokenizer.json")
    empty = manifest(work, "empty.jsonl", "", "  ")
    refused(run("make_multimodal.py", "--model", MODEL, "--out", out, empty), "make_multimodal",
            f"{empty}: no samples")
    assert not os.path.exists(out), "a refused run wrote its output"


def check_model_defaults(work):
    """A model directory with a tokenizer.json and a preprocessor_config.json: the text is
    tokenized by it and the images sized by its bounds, as its processor would, unless the
    flags say otherwise."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    model_dir = os.path.join(work, "model-with-processor")
    os.makedirs(model_dir)
    shutil.copy(os.path.join(MODEL, "config.json"), model_dir)
    words = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 7, "red": 9}, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    words.save(os.path.join(model_dir, "tokenizer.json"))
    with open(os.path.join(model_dir, "preprocessor_config.json"), "w") as f:
        json.dump({"min_pixels": 28 * 28, "max_pixels": 56 * 56}, f)
    picture(work, "big.png", (112, 112))
    lines = manifest(work, "words.jsonl", {"text": "a <image> red", "images": ["big.png"]})
    out = os.path.join(work, "words")
    made = run("make_multimodal.py", "--model", model_dir, "--out", out, lines)
    assert made.returncode == 0, made.stderr
    assert "text tokenized by " + os.path.join(model_dir, "tokenizer.json") in made.stdout, made.stdout
    sample = json.loads(open(os.path.join(out, "samples.jsonl")).readline())
    config = json.load(open(os.path.join(MODEL, "config.json")))
    ids = sample["input_ids"]
    assert ids[0] == 7 and ids[-1] == 9 and ids[1] == config["vision_start_token_id"], ids
    assert sample["images"][0]["grid"] == [1, 14, 14], sample["images"][0]  # 56 x 56 pixels at most, patches of 4
    # A prompt and its completion: the prompt's tokens, its image's included, are counted.
    lines = manifest(work, "prompted.jsonl", {"prompt": "a <image>", "completion": "red a", "images": ["big.png"]})
    made = run("make_multimodal.py", "--model", model_dir, "--out", out + "-prompted", lines)
    assert made.returncode == 0 and "1 with a prompt" in made.stdout, (made.stderr, made.stdout)
    sample = json.loads(open(os.path.join(out + "-prompted", "samples.jsonl")).readline())
    placeholders = 14 * 14 // 4
    assert sample["prompt_length"] == 1 + placeholders + 2, sample["prompt_length"]
    assert sample["input_ids"][sample["prompt_length"]:] == [9, 7], sample["input_ids"]
    # The flags still rule.
    made = run("make_multimodal.py", "--model", model_dir, "--max-pixels", str(112 * 112), "--out", out + "-big", lines)
    assert made.returncode == 0, made.stderr
    grid = json.loads(open(os.path.join(out + "-big", "samples.jsonl")).readline())["images"][0]["grid"]
    assert grid == [1, 28, 28], grid


def check_example_help(work):
    shown = subprocess.run([sys.executable, os.path.join(SCRIPTS, "make_multimodal_example.py"), "--help"],
                           capture_output=True, text=True, cwd=work)
    assert shown.returncode == 0 and "--out" in shown.stdout and not os.listdir(os.path.join(work)), \
        (shown.returncode, shown.stderr, os.listdir(work))
    made = subprocess.run([sys.executable, os.path.join(SCRIPTS, "make_multimodal_example.py"), "--out",
                           os.path.join(work, "example"), "--model", MODEL], capture_output=True, text=True, cwd=work)
    assert made.returncode == 0, made.stderr
    samples = open(os.path.join(work, "example", "dataset", "samples.jsonl")).read().splitlines()
    assert len(samples) == 22, len(samples)  # 16 pictures, 2 clips, 4 texts


def main():
    work = tempfile.mkdtemp(prefix="check-make-multimodal-", dir=os.environ.get("WORK"))
    try:
        check_make_tokens(work)
        check_red_pixel(work)
        check_multimodal_refusals(work)
        check_model_defaults(work)
        help_dir = os.path.join(work, "help")
        os.makedirs(help_dir)
        check_example_help(help_dir)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print("ok: make_tokens.py keeps its inputs and other files, a 1x1 red picture stays red, every refusal of "
          "make_multimodal.py is one line, a model's own tokenizer and image bounds are its defaults, "
          "make_multimodal_example.py answers --help")


if __name__ == "__main__":
    main()
