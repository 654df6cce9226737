"""A seeded mutation campaign against the real fsdpp binary. Each case starts from a valid input
(a run file, --set overrides, an HF config.json, model.safetensors, a shard index, a sharded
checkpoint, a token file, a multimodal dataset), applies one to three random mutations, runs
the command that reads it and classifies how it ended. "ok" (exit 0) and "refused" (exit 2,
exactly one "fsdpp: error:" line among ordinary log lines) pass; a signal, a timeout, an
internal error (exit 1 or "internal error"), exit 2 with noise or several error lines
("multi-line") and any other exit status fail, and the case is kept in WORK/failures/<family>-<n>/
with its inputs, command, mutations and output. The same --seed gives the same mutations.

FSDPP=build/fsdpp WORK=/tmp/w FIXTURES=build/tests/fixtures .venv/bin/python \
    tests/io/mutation_campaign.py [--cases 40] [--seed 1] [--families toml,set] [--timeout 60] [--jobs 2]"""
import argparse
import concurrent.futures
import functools
import json
import os
import random
import re
import shlex
import shutil
import signal
import struct
import subprocess
import sys
import tomllib

from crc32c import crc32c
from PIL import Image, ImageDraw

FSDPP = os.path.abspath(os.environ["FSDPP"])
WORK = os.path.abspath(os.environ["WORK"])
FIXTURES = os.path.abspath(os.environ["FIXTURES"])
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BASE = os.path.join(WORK, "base")
RUN_TOML = os.path.join(BASE, "run.toml")
CHECKPOINT = os.path.join(BASE, "ckpt-run", "checkpoints", "step-00000002")
TOML_SEEDS = ["tests/assets/fsdp-llama.toml", "examples/tiny-llama.toml", "examples/tiny-llama-custom-policy.toml",
              "examples/tiny-qwen2-vl.toml", "examples/llama-1b-gpu.toml", RUN_TOML]
KINDS = ("ok", "refused", "signal", "timeout", "internal", "multi-line", "other-exit")
LOG_LINE = re.compile(r"^\d\d:\d\d:\d\d (\[rank \d+\] )?(debug|info|warning|error) ")
CRASH_WORDS = ("internal error", "terminate called", "Traceback", "Segmentation")
ODD_JSON = [0, -1, 1, 2**31, 2**63, 2**64, -2**63, 1e308, -1e308, 1.5, 1e-320, float("nan"), float("inf"),
            "", "x", "../x", "/etc/passwd", None, True, [], {}, [0, -1], {"a": 1}]
# No value names a writable place outside the case directory (cases run as whoever runs this).
ODD_TOML = ['""', '"x"', '"sub/x"', '"/dev/null"', '"\\u0000"', '"' + "a" * 4096 + '"', "0", "-1", "1", "3",
            "9223372036854775807", "-9223372036854775808", "99999999999999999999", "1e308", "-1e-320", "nan",
            "inf", "-inf", "0.5", "true", "[]", '[1, "a"]', "{}", "{ a = 1 }", "1979-05-27T07:32:00Z", "'''\nx'''"]
# Every key the default example documents (but steps: a huge one is a run, not a bad input).
SET_KEYS = [f"{s}.{k}" for s, keys in tomllib.load(open(os.path.join(REPO, "examples/tiny-llama.toml"), "rb")).items()
            for k in keys if k != "steps"] + ["policy.name", "policy.options.shard_size", "policy.options.offload"]


# Mutations: each returns the new content and a one-line description.
def mutate_bytes(rng, data, lo=0, hi=None):
    """One byte-level edit at a position in [lo, hi)."""
    hi = len(data) if hi is None else min(hi, len(data))
    at = rng.randrange(lo, hi) if hi > lo else len(data)
    kind = rng.choice(["flip", "delete", "insert", "duplicate-line", "truncate"])
    if kind == "flip" and at < len(data):
        bit = rng.randrange(8)
        return data[:at] + bytes([data[at] ^ (1 << bit)]) + data[at + 1:], f"flip bit {bit} of byte {at}"
    if kind == "delete":
        n = rng.randint(1, 16)
        return data[:at] + data[at + n:], f"delete {n} bytes at {at}"
    if kind == "duplicate-line":
        lines = data.split(b"\n")
        i, j = rng.randrange(len(lines)), rng.randrange(len(lines) + 1)
        return b"\n".join(lines[:j] + [lines[i]] + lines[j:]), f"duplicate line {i + 1} before line {j + 1}"
    if kind == "truncate":
        return data[:at], f"truncate to {at} bytes"
    extra = rng.choice([b"\x00", b'"', b"[", b"]", b"{", b"=", b"\n", b"\xff\xfe", b"9" * 30, rng.randbytes(8)])
    return data[:at] + extra + data[at:], f"insert {extra!r} at {at}"


def json_paths(doc, path=()):
    yield path
    items = doc.items() if isinstance(doc, dict) else enumerate(doc) if isinstance(doc, list) else ()
    for key, value in items:
        yield from json_paths(value, path + (key,))


def mutate_json(rng, doc):
    """Replaces (with another type, or another number), deletes or adds one node anywhere."""
    path = rng.choice(list(json_paths(doc)))
    parent = functools.reduce(lambda node, key: node[key], path[:-1], doc)
    node = parent[path[-1]] if path else doc
    where = "/".join(map(str, path)) or "<root>"
    kind = rng.choice(["replace", "replace", "number", "delete", "add"])
    if kind == "add" and isinstance(node, (dict, list)):
        value = rng.choice(ODD_JSON)
        node.update(fsdpp_unknown=value) if isinstance(node, dict) else node.append(value)
        return doc, f"json: add {value!r} to {where}"
    if kind == "delete" and path:
        del parent[path[-1]]
        return doc, f"json: delete {where}"
    if kind == "number" and isinstance(node, (int, float)) and not isinstance(node, bool):
        value = rng.choice([0, -node, node + 0.5, node * 2**40, node - 1, str(node)])
    else:
        value = rng.choice(ODD_JSON)
    if not path:
        return value, f"json: replace the document with {value!r}"
    parent[path[-1]] = value
    return doc, f"json: {where} {node!r:.40} -> {value!r:.40}"


def load_json(data):
    try:
        return json.loads(data)
    except ValueError:  # not JSON (any more)
        return None


def mutate_json_file(rng, data, byte_share=0.25, line=False):
    """A JSON-aware mutation, or a byte-level one byte_share of the time or once it is not JSON;
    `line` keeps the document on one line."""
    doc = load_json(data)
    if doc is None or rng.random() < byte_share:
        return mutate_bytes(rng, data)
    doc, what = mutate_json(rng, doc)
    return (json.dumps(doc) if line else json.dumps(doc, indent=1) + "\n").encode(), what


def mutate_toml(rng, text):
    lines = text.split("\n")
    kind = rng.choice(["value", "value", "value", "unknown-key", "unknown-section", "bytes", "bytes"])
    assigns = [i for i, line in enumerate(lines) if re.match(r"\s*[\w.]+\s*=", line)]
    if kind == "value" and assigns:
        i, value = rng.choice(assigns), rng.choice(ODD_TOML)
        key = lines[i].split("=")[0].strip()
        lines[i] = f"{key} = {value}"
        return "\n".join(lines), f"line {i + 1}: {key} = {value:.40}"
    if kind == "unknown-key":
        i = rng.randrange(len(lines) + 1)
        return "\n".join(lines[:i] + ["bogus_key = 1"] + lines[i:]), f"unknown key before line {i + 1}"
    if kind == "unknown-section":
        section = rng.choice(["[bogus]", "[train.extra]", "[[train]]", "[policy.options.deep]", "[]"])
        return text + f"\n{section}\nkey = 1\n", f"append section {section}"
    data, what = mutate_bytes(rng, text.encode())
    return data.decode("utf-8", "replace"), what


def tensor_spans(header):
    """name -> data_offsets of the well-formed entries: of the integer tensors when there are some."""
    spans = {k: v for k, v in header.items()
             if isinstance(v, dict) and list(map(type, v.get("data_offsets", []))) == [int, int]}
    whole = {k: v["data_offsets"] for k, v in spans.items() if v.get("dtype") not in ("F16", "BF16", "F32", "F64")}
    return whole or {k: v["data_offsets"] for k, v in spans.items()}


def mutate_safetensors(rng, data):
    """The header length, a header field (dtype, shape, data_offsets, any node), header bytes, a
    tensor's bytes (an integer one's when there is one: those carry structure), truncation."""
    size = struct.unpack("<Q", data[:8])[0] if len(data) >= 8 else 0
    header = load_json(data[8:8 + size]) if size < len(data) else None
    kind = rng.choice(["length", "field", "field", "field", "header-bytes", "data", "truncate"])
    if len(data) < 8 or (kind in ("field", "data") and not isinstance(header, dict)):
        return mutate_bytes(rng, data)
    spans = tensor_spans(header) if kind == "data" else {}
    if spans:
        name = rng.choice(sorted(spans))
        data, what = mutate_bytes(rng, data, 8 + size + spans[name][0], 8 + size + spans[name][1])
        return data, f"{name} data: {what}"
    if kind == "length":
        new = rng.choice([0, 1, 2, size - 1, size + 1, len(data), len(data) - 8, 2**63, 2**64 - 1, 2**32 + size])
        new %= 2**64
        return struct.pack("<Q", new) + data[8:], f"header length {size} -> {new}"
    if kind == "truncate":
        at = rng.choice([rng.randrange(8), rng.randrange(8 + size), rng.randrange(len(data))])
        return data[:at], f"truncate to {at} bytes"
    if kind == "header-bytes":
        return mutate_bytes(rng, data, 8, 8 + size)
    name = rng.choice([k for k in header if k != "__metadata__"] or ["x"])
    field = rng.choice(["dtype", "shape", "data_offsets", "json"])
    values = {"dtype": ["F16", "BF16", "F64", "I64", "U8", "BOOL", "F8_E4M3", "XYZ", "", 5, None],
              "shape": [[], [0], [-1], [2**40, 2**40], [1] * 9, [1.5], "3", [2**63]],
              "data_offsets": [[0, 0], [1, 0], [0, 2**63], [-4, 4], [0], [0, 4, 8], [0.5, 4], "0"]}
    if field == "json" or not isinstance(header.get(name), dict) or field not in header[name]:
        header, what = mutate_json(rng, header)
    else:
        value = rng.choice(values[field] + ([header[name][field][::-1]] if field != "dtype" else ["F32"]))
        header[name][field], what = value, f"{name}.{field} -> {value!r}"
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data[8 + size:], f"header {what}"


def edit(path, change):
    """Applies change(bytes) -> (bytes, description) to the file; returns the description."""
    data, what = change(open(path, "rb").read())
    open(path, "wb").write(data)
    return f"{os.path.basename(path)}: {what}"


# The valid inputs, made once before the cases run.
def make_multimodal():
    """A dataset made by scripts/make_multimodal.py for the qwen2_vl fixture: images, videos, text."""
    os.makedirs(os.path.join(BASE, "images"))
    lines = []
    for i, colour in enumerate(["red", "blue", "green"]):
        for step in range(2):
            image = Image.new("RGB", (32, 32), (245, 245, 245))
            ImageDraw.Draw(image).rectangle((4 + 4 * step, 8, 20 + 4 * step, 24), fill=(60 * i, 200 - 60 * i, 90))
            image.save(os.path.join(BASE, "images", f"{colour}-{step}.png"))
        lines += [{"text": f"<image>A {colour} square.", "images": [f"images/{colour}-0.png"]},
                  {"text": f"A {colour} square moves: <video>",
                   "videos": [[f"images/{colour}-{s}.png" for s in (0, 1)]]},
                  {"text": f"Plain words about {colour}."}]
    with open(os.path.join(BASE, "manifest.jsonl"), "w") as f:
        f.writelines(json.dumps(line) + "\n" for line in lines)
    subprocess.run([sys.executable, os.path.join(REPO, "scripts/make_multimodal.py"), "--model", f"{FIXTURES}/qwen2_vl",
                    "--out", os.path.join(BASE, "mm"), "--min-pixels", "256", "--max-pixels", "1024",
                    os.path.join(BASE, "manifest.jsonl")], check=True, capture_output=True)


def prepare():
    """A token file within the tiny Llama's vocabulary of 101, a run file training it, the example
    corpus (for the run files of examples/), a multimodal dataset and a checkpoint saved at world 2."""
    os.makedirs(BASE)
    rng = random.Random(0)
    tokens = [rng.randrange(101) for _ in range(4000)]
    with open(os.path.join(BASE, "base.tok"), "wb") as f:
        f.write(b"FSDPTOK\x00" + struct.pack(f"<IIQQ{len(tokens)}H", 1, 2, len(tokens), 101, *tokens))
    with open(RUN_TOML, "w") as f:
        f.write(f'[model]\npath = "{FIXTURES}/llama_untied"\n[data]\ntrain = "{BASE}/base.tok"\nseq_len = 16\n'
                'batch_size = 2\neval_fraction = 0.1\n[train]\nsteps = 1\nthreads = 1\n'
                '[metrics]\nprogress = "never"\n')
    subprocess.run(["bash", "scripts/make_corpus.sh"], cwd=REPO, check=True, capture_output=True)
    make_multimodal()
    subprocess.run([FSDPP, "launch", "--nproc-per-node", "2", "--", "train", RUN_TOML, "--set", "train.steps=2",
                    "--set", f'train.out_dir="{BASE}/ckpt-run"', "--set", "checkpoint.save_every=2"],
                   check=True, capture_output=True, timeout=300, cwd=BASE)


# Families: each writes its inputs into `case`, mutates them `rounds` times and returns the
# argv to run and the mutations made.
def sets(*pairs):
    return [a for p in pairs for a in ("--set", p)]


def short_train(case, *pairs, config=RUN_TOML):
    return ["train", config, *sets(f'train.out_dir="{case}/out"', "train.steps=1", "train.threads=1", *pairs)]


def any_command(rng, case, *pairs, plan=True):
    """A 1-step train, an eval of one window or (when `plan`) a plan for 1-4 ranks."""
    commands = [short_train(case, *pairs), ["eval", RUN_TOML, "--max-windows", "1", *sets(*pairs)]]
    if plan:
        commands.append(["plan", RUN_TOML, "--world", str(rng.randint(1, 4)), *sets(*pairs)])
    return rng.choice(commands)


def family_toml(rng, case, rounds):
    seed = rng.choice(TOML_SEEDS)
    text = open(os.path.join(REPO, seed)).read().replace("data/multimodal-example/dataset", f"{BASE}/mm")
    text = re.sub(r'"(tests|examples|data)/', rf'"{REPO}/\1/', text)  # cases run in their own directory
    done = [f"seed {seed}"]
    for _ in range(rounds):
        text, what = mutate_toml(rng, text)
        done.append(f"run.toml: {what}")
    config = os.path.join(case, "run.toml")
    with open(config, "w") as f:
        f.write(text)
    plan = seed.endswith("gpu.toml") or rng.random() < 0.4  # the 1.1B model is only planned
    return (["plan", config] if plan else short_train(case, config=config)), done


def family_set(rng, case, rounds):
    pairs = ["optimizer.lr=1e-3", "data.seq_len=8", "train.clip_grad_norm=0.5", 'scheduler.kind="linear"',
             "checkpoint.save_final=false"]
    extras, done = [], []
    for _ in range(rounds):
        i = rng.randrange(len(pairs))
        key, _, value = pairs[i].partition("=")
        kind = rng.choice(["value", "value", "key", "typo", "raw", "argv"])
        if kind == "value":
            key, value = rng.choice(SET_KEYS), rng.choice(ODD_TOML)
        elif kind == "key":
            key = rng.choice(["", ".", "train.", ".steps", "train..steps", "bogus.key", "train.steps.x", "a" * 300,
                              "policy.options", "policy.options.", "train.steps ", "TRAIN.STEPS", "train.out_dir"])
        elif kind == "typo":
            key = mutate_bytes(rng, key.encode())[0].decode("utf-8", "replace").replace("\0", "")  # argv holds no NUL
        elif kind == "raw":
            key, value = rng.choice([(key, None), (key + "=", None), ("", value), ("=", "="), ("", None),
                                     (key, value + "\n[x]"), (key, " 1 2")])
        else:
            extras.append(rng.choice([["--bogus"], ["--set"], ["-s", "x"], ["--world"], ["--world", "0"], ["--json"],
                                      ["--tokens"], ["--max-windows", "-1"], ["--"], [""], ["--resume"], ["--verbose"],
                                      ["extra.toml"], ["--world", "99999999999999999999"], ["--tokens", "/dev/null"]]))
            done.append(f"argv + {extras[-1]}")
            continue
        pairs[i] = key if value is None else f"{key}={value}"
        done.append(f"--set {pairs[i]!r:.80}")
    return any_command(rng, case) + sets(*pairs) + [a for extra in extras for a in extra], done


def hf_copy(case, fixture):
    model = os.path.join(case, "model")
    shutil.copytree(os.path.join(FIXTURES, fixture), model, ignore=shutil.ignore_patterns("reference.safetensors"))
    return model


def family_hf_file(rng, case, rounds, fixtures, name, mutate, plan):
    """One file of a fixture's HF directory mutated; a 1-step train, an eval or a plan."""
    fixture = rng.choice(fixtures)
    model = hf_copy(case, fixture)
    done = [f"fixture {fixture}"] + [edit(os.path.join(model, name), lambda d: mutate(rng, d)) for _ in range(rounds)]
    return any_command(rng, case, f'model.path="{model}"', plan=plan), done


def mutate_index(rng, data, shards):
    """Points, or drops, one weight_map entry (or a generic JSON/byte mutation)."""
    index = load_json(data)
    weights = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weights, dict) or not weights or rng.random() < 0.3:
        return mutate_json_file(rng, data, 0.5)
    name = rng.choice(sorted(weights))
    if rng.random() < 0.2:
        del weights[name]
        return json.dumps(index).encode(), f"drop {name}"
    weights[name] = rng.choice(["../x", "../../../etc/passwd", "/etc/passwd", "", ".", "config.json",
                                "model.safetensors", "model.safetensors.index.json", "missing.safetensors",
                                f"./{shards[0]}", f"sub/../{shards[0]}", rng.choice(shards), 3, None, [shards[0]],
                                "x" * 5000])
    return json.dumps(index).encode(), f"{name} -> {weights[name]!r:.60}"


def family_index(rng, case, rounds):
    model = hf_copy(case, "llama_sharded")
    shards = sorted(f for f in os.listdir(model) if f.startswith("model-"))
    path = os.path.join(model, "model.safetensors.index.json")
    done = [edit(path, lambda d: mutate_index(rng, d, shards)) for _ in range(rounds)]
    return any_command(rng, case, f'model.path="{model}"', plan=False), done


def family_checkpoint(rng, case, rounds):
    """Metadata or another file mutated; when forged, metadata.json's record of a changed file and
    metadata.crc32c are rewritten to match, so the checks behind the checksums are reached."""
    ckpt = os.path.join(case, "step-00000002")
    shutil.copytree(CHECKPOINT, ckpt)
    meta_path = os.path.join(ckpt, "metadata.json")
    forged = rng.random() < 0.5
    done = ["checksums forged" if forged else "checksums left"]
    for _ in range(rounds):
        name = rng.choice(["metadata.json"] * 3 + sorted(f for f in os.listdir(ckpt) if f != "metadata.json"))
        mutate = mutate_safetensors if name.endswith(".safetensors") and rng.random() < 0.5 else \
            mutate_json_file if name.endswith(".json") else mutate_bytes
        done.append(edit(os.path.join(ckpt, name), lambda d: mutate(rng, d)))
        meta = load_json(open(meta_path, "rb").read())
        if forged and isinstance(meta, dict) and isinstance(meta.get("files"), dict) and name in meta["files"]:
            data = open(os.path.join(ckpt, name), "rb").read()
            meta["files"][name] = {"bytes": len(data), "checksum": f"crc32c:{crc32c(data):08x}"}
            open(meta_path, "w").write(json.dumps(meta, indent=1) + "\n")
        if forged and name != "metadata.crc32c":
            crc = crc32c(open(meta_path, "rb").read())
            open(os.path.join(ckpt, "metadata.crc32c"), "w").write(f"crc32c:{crc:08x}\n")
    if rng.random() < 0.5:
        return ["export", ckpt, os.path.join(case, "exported")], done
    return short_train(case, f'checkpoint.resume="{ckpt}"', "train.steps=3"), done


def mutate_tokens(rng, data):
    """A header field (magic byte, version, width, count, vocabulary) or the body."""
    field = rng.choice(["magic", "version", "width", "count", "vocab", "body", "body"])
    if field == "body":
        return mutate_bytes(rng, data, 32)
    at, fmt = {"magic": (rng.randrange(8), "<B"), "version": (8, "<I"), "width": (12, "<I"),
               "count": (16, "<Q"), "vocab": (24, "<Q")}[field]
    value = rng.choice([0, 1, 3, 8, 50, 100, 102, 2**31, 2**32 - 1, 3999, 4001, 2**40, 2**63, 2**64 - 1])
    value %= 2 ** (8 * struct.calcsize(fmt))
    return data[:at] + struct.pack(fmt, value) + data[at + struct.calcsize(fmt):], f"{field} -> {value}"


def family_tokens(rng, case, rounds):
    path = os.path.join(case, "data.tok")
    shutil.copy(os.path.join(BASE, "base.tok"), path)
    done = [edit(path, lambda d: mutate_tokens(rng, d)) for _ in range(rounds)]
    if rng.random() < 0.3:
        return ["eval", RUN_TOML, "--tokens", path, "--max-windows", "2"], done
    return short_train(case, f'data.train="{path}"', f"data.shuffle={rng.choice(['true', 'false'])}"), done


def mutate_samples(rng, data):
    """One line of samples.jsonl, JSON-aware or bytes."""
    lines = data.split(b"\n")
    i = rng.randrange(max(1, len(lines) - 1))
    lines[i], what = mutate_json_file(rng, lines[i], 0.3, line=True)
    return b"\n".join(lines), f"line {i + 1}: {what}"


def family_multimodal(rng, case, rounds):
    data = os.path.join(case, "mm")
    shutil.copytree(os.path.join(BASE, "mm"), data)
    done = [edit(os.path.join(data, "pixels.safetensors"), lambda d: mutate_safetensors(rng, d)) if rng.random() < 0.3
            else edit(os.path.join(data, "samples.jsonl"), lambda d: mutate_samples(rng, d)) for _ in range(rounds)]
    # Nothing held out: the run file's eval_fraction of 0.1 holds out no whole sample of nine.
    return short_train(case, f'model.path="{FIXTURES}/qwen2_vl"', f'data.train="{data}"', "data.seq_len=64",
                       "data.eval_fraction=0"), done


HF_FIXTURES = ["llama_untied", "llama_tied_rope3", "qwen2", "qwen3", "qwen2_vl", "qwen2_5_vl"]
FAMILIES = {"toml": family_toml, "set": family_set,
            "config_json": functools.partial(family_hf_file, fixtures=HF_FIXTURES, name="config.json",
                                             mutate=lambda rng, d: mutate_json_file(rng, d, 0.15), plan=True),
            "safetensors": functools.partial(family_hf_file, fixtures=["llama_untied", "qwen2", "qwen3"],
                                             name="model.safetensors", mutate=mutate_safetensors, plan=False),
            "index": family_index, "checkpoint": family_checkpoint, "tokens": family_tokens,
            "multimodal": family_multimodal}


def fsdpp(argv, cwd, timeout):
    """Runs fsdpp in its own process group; returns (exit status or None on timeout, stdout, stderr)."""
    proc = subprocess.Popen([FSDPP, *argv], cwd=cwd, env=dict(os.environ, OMP_NUM_THREADS="1"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        (out, err), rc = proc.communicate(), None
    return rc, out.decode(errors="replace"), err.decode(errors="replace")


def classify(rc, stderr):
    if rc is None:
        return "timeout"
    if rc < 0:
        return "signal"
    if rc == 1 or any(w in stderr for w in CRASH_WORDS):
        return "internal"
    if rc != 2:
        return "ok" if rc == 0 else "other-exit"
    lines = stderr.splitlines()
    errors = [line for line in lines if line.startswith("fsdpp: error:")]
    noise = [line for line in lines if not line.startswith("fsdpp: error:") and not LOG_LINE.match(line)]
    return "refused" if len(errors) == 1 and not noise else "multi-line"


def run_case(family, n, seed, timeout, rounds=None):
    """Makes, runs and classifies case n of `family`; keeps its files only when it fails."""
    rng = random.Random(f"{seed}:{family}:{n}")
    case = os.path.join(WORK, "cases", f"{family}-{n}")
    os.makedirs(case)
    argv, done = FAMILIES[family](rng, case, rng.randint(1, 3) if rounds is None else rounds)
    rc, out, err = fsdpp(argv, case, timeout)
    kind = classify(rc, err)
    if kind in ("ok", "refused"):
        shutil.rmtree(case)
        return family, n, kind, None
    kept = os.path.join(WORK, "failures", f"{family}-{n}")
    shutil.move(case, kept)
    command = f"cd {kept} && OMP_NUM_THREADS=1 {shlex.join([FSDPP, *argv])}".replace(case, kept)
    for name, text in [("command.txt", command), ("mutations.txt", "\n".join(done)), ("stdout.txt", out),
                       ("stderr.txt", err), ("ending.txt", f"{kind}, exit {rc}")]:
        open(os.path.join(kept, name), "w").write(text + "\n")
    return family, n, kind, kept


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", type=int, default=40, help="cases per family")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--families", default=",".join(FAMILIES), help=f"some of {','.join(FAMILIES)}")
    ap.add_argument("--timeout", type=float, default=60, help="seconds per case")
    ap.add_argument("--jobs", type=int, default=2, help="cases run at once")
    args = ap.parse_args()
    families = args.families.split(",")
    if set(families) - set(FAMILIES):
        sys.exit(f"unknown families {sorted(set(families) - set(FAMILIES))}; known: {', '.join(FAMILIES)}")
    for d in ("base", "cases", "failures"):
        shutil.rmtree(os.path.join(WORK, d), ignore_errors=True)
    os.makedirs(os.path.join(WORK, "failures"))
    prepare()
    for family in families:  # the unmutated input must run, else the family tests nothing
        _, _, kind, kept = run_case(family, "baseline", args.seed, args.timeout, rounds=0)
        if kind != "ok":
            sys.exit(f"{family}: the unmutated case ended {kind}, see {kept}")
    tally = {f: dict.fromkeys(KINDS, 0) for f in families}
    failed = []
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        for job in [pool.submit(run_case, f, n, args.seed, args.timeout) for f in families for n in range(args.cases)]:
            family, n, kind, kept = job.result()
            tally[family][kind] += 1
            if kept:
                failed.append(f"{kind:<10} {kept}: {open(os.path.join(kept, 'mutations.txt')).read().strip()}")
    print(f"{'family':<12} {'cases':>5} " + " ".join(f"{k:>10}" for k in KINDS))
    for family, counts in tally.items():
        print(f"{family:<12} {sum(counts.values()):>5} " + " ".join(f"{counts[k]:>10}" for k in KINDS))
    print("\n".join(failed))
    print(f"{len(failed)} failing case(s), seed {args.seed}" if failed else f"no failures, seed {args.seed}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
