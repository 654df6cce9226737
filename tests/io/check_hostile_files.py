"""Files nobody here wrote, crafted to break the engine, must each end with exit status 2
and one "fsdpp: error:" line that names the file and what is wrong: no crash, no hang, no
read outside a checkpoint or model directory, no silent use. The checkpoint cases rewrite
metadata.json and its checksum file together, as a deliberate forger would, so the field
checks behind the checksum are reached too."""
import json
import os
import shutil
import struct
import subprocess
import sys

from crc32c import crc32c
from safetensors.torch import load_file, save_file
import torch

FSDPP = os.environ["FSDPP"]
WORK = os.path.join(os.environ["WORK"], "hostile")
CONFIG = "tests/assets/fsdp-llama.toml"
TIMEOUT_S = 60


def fsdpp(*args):
    try:
        return subprocess.run([FSDPP, *args], capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return None


failures = 0


def expect(name, patterns, *args):
    """The run must exit 2 with exactly one error line holding every pattern, and nothing
    that looks like a crash."""
    global failures
    proc = fsdpp(*args)
    if proc is None:
        ok, detail = False, f"no end within {TIMEOUT_S} s"
    else:
        errors = [l for l in proc.stderr.splitlines() if l.startswith("fsdpp: error:")]
        crashed = any(w in proc.stderr for w in ("internal error", "Traceback", "terminate called", "Segmentation"))
        ok = proc.returncode == 2 and len(errors) == 1 and not crashed and all(p in errors[0] for p in patterns)
        detail = errors[0] if len(errors) == 1 else f"exit {proc.returncode}: {proc.stderr.strip()[-600:]}"
    failures += not ok
    print(f"{'ok  ' if ok else 'FAIL'} {name}: {detail}")


def forge(checkpoint, name, change):
    """A copy of `checkpoint` whose metadata `change` edits, with a matching checksum."""
    out = os.path.join(WORK, name)
    shutil.copytree(checkpoint, out)
    with open(os.path.join(out, "metadata.json")) as f:
        meta = json.load(f)
    change(meta, out)
    text = (json.dumps(meta, indent=1) + "\n").encode()
    with open(os.path.join(out, "metadata.json"), "wb") as f:
        f.write(text)
    with open(os.path.join(out, "metadata.crc32c"), "w") as f:
        f.write(f"crc32c:{crc32c(text):08x}\n")
    return out


def zero_rank0_rng(meta, d):
    """Zeroes rank 0's saved generator state and records the file's new checksum."""
    path = os.path.join(d, "rank-00000.safetensors")
    with open(path, "rb") as f:
        data = bytearray(f.read())
    header_len = struct.unpack("<Q", data[:8])[0]
    begin, end = json.loads(data[8:8 + header_len])["rng/cpu"]["data_offsets"]
    data[8 + header_len + begin:8 + header_len + end] = bytes(end - begin)
    with open(path, "wb") as f:
        f.write(data)
    meta["files"]["rank-00000.safetensors"]["checksum"] = f"crc32c:{crc32c(bytes(data)):08x}"


def checkpoint_cases(ckpt):
    first_tensor = lambda meta: next(iter(meta["tensors"].values()))  # noqa: E731
    export = lambda path: ("export", path, os.path.join(WORK, "exported"))  # noqa: E731

    edited = os.path.join(WORK, "edited")
    shutil.copytree(ckpt, edited)
    with open(os.path.join(edited, "metadata.json"), "a") as f:
        f.write(" ")
    expect("metadata edited, checksum not", ["metadata.json", "does not match the metadata.crc32c"], *export(edited))
    unsummed = os.path.join(WORK, "unsummed")
    shutil.copytree(ckpt, unsummed)
    os.remove(os.path.join(unsummed, "metadata.crc32c"))
    expect("metadata checksum missing", ["metadata.crc32c, which is missing"], *export(unsummed))

    cases = [
        ("world_size 0", ["world_size must be an integer in [1, 1048576], got 0"],
         lambda m, d: m.update(world_size=0)),
        ("world_size 2^40", ["world_size must be an integer in [1, 1048576]"], lambda m, d: m.update(world_size=2**40)),
        ("step 1e30", ["step must be an integer in [0, 1000000000000], got 1e+30"], lambda m, d: m.update(step=1e30)),
        ("negative step", ["step must be an integer"], lambda m, d: m.update(step=-5)),
        ("negative optimizer steps", ["optimizer.steps must be an integer"],
         lambda m, d: m["optimizer"].update(steps=-1)),
        ("files key ../", ["outside"], lambda m, d: m["files"].update({"../metadata.json": m["files"].pop("config.json")})),
        ("absolute shard file", ["outside"],
         lambda m, d: m["files"].update({"/etc/passwd": {"bytes": os.path.getsize("/etc/passwd"), "checksum": "0"}})),
        ("shard file not listed", ["which files does not list"],
         lambda m, d: first_tensor(m)["shards"][0].update(file="other.safetensors")),
        ("negative shape", ["shape must be an integer in [0,"], lambda m, d: first_tensor(m).update(shape=[-3, 30])),
        ("shape overflowing", ["shape holds too many elements"],
         lambda m, d: first_tensor(m).update(shape=[2**40, 2**40])),
        ("shard rows outside", ["shard rows must be an integer"],
         lambda m, d: first_tensor(m)["shards"][0].update(rows=[0, 10**9])),
        ("dtype not a string", ["malformed checkpoint metadata"], lambda m, d: m["model"].update(dtype=5)),
        ("rank file a link", ["rank-00000.safetensors, which is a link"],
         lambda m, d: (os.remove(os.path.join(d, "rank-00000.safetensors")),
                       os.symlink("/etc/passwd", os.path.join(d, "rank-00000.safetensors")))),
        ("a tensor missing", ["no tensor model/model.norm.weight"],
         lambda m, d: m["tensors"].pop("model/model.norm.weight")),
        # The export would leave it out without a word where a resume refuses it.
        ("a tensor the model has not", ["holds a tensor 'model.bogus.weight' that a llama", "another architecture"],
         lambda m, d: m["tensors"].update({"model/model.bogus.weight": m["tensors"]["model/model.norm.weight"]})),
    ]
    for name, patterns, change in cases:
        expect(name, patterns, *export(forge(ckpt, name.replace(" ", "-").replace("/", "-"), change)))
    far = forge(ckpt, "window-outside", lambda m, d: m["data"].update(window=10**9))
    expect("window outside the epoch", ["data.window 1000000000 is outside an epoch"],
           "train", CONFIG, "--set", f'train.out_dir="{WORK}/resumed"', "--set", f'checkpoint.resume="{far}"')
    broken_rng = forge(ckpt, "rng-zeroed", zero_rank0_rng)
    expect("generator state zeroed", ["rank-00000.safetensors: rng/cpu is not a generator state"],
           "train", CONFIG, "--set", f'train.out_dir="{WORK}/resumed"', "--set", f'checkpoint.resume="{broken_rng}"')
    # A checkpoint of another architecture is refused at resume, before the run uses a row: a
    # wider vocabulary would read the checkpoint's rows in range (its shape is refused), fewer
    # layers would leave some out (the config is refused, naming the field).
    source = json.load(open("tests/assets/models/fsdp-llama/config.json"))
    layers = source["num_hidden_layers"]
    for name, change, patterns in [
            ("a wider vocabulary", {"vocab_size": source["vocab_size"] + 24},
             [f"tensor 'model.embed_tokens.weight' is [{source['vocab_size']}, ", "another architecture"]),
            ("fewer layers", {"num_hidden_layers": layers - 1},
             ["saved another model than this run's", f"num_hidden_layers {layers} -> {layers - 1}"])]:
        other = os.path.join(WORK, "other-" + name.replace(" ", "-"))
        os.makedirs(other)
        json.dump({**source, **change}, open(os.path.join(other, "config.json"), "w"))
        expect(f"resume onto {name}", patterns,
               "train", CONFIG, "--set", f'model.path="{other}"', "--set", f'train.out_dir="{other}-run"',
               "--set", f'checkpoint.resume="{ckpt}"')
    # A checkpoint that lost its metadata, given as a model: named as a torn checkpoint, not as
    # a model directory short of model.safetensors.
    torn = os.path.join(WORK, "torn-checkpoint")
    shutil.copytree(ckpt, torn)
    os.remove(os.path.join(torn, "metadata.json"))
    expect("a checkpoint without its metadata as [model] path",
           ["torn-checkpoint: holds rank-0000", "a checkpoint's rank file", "not a complete checkpoint"],
           "train", CONFIG, "--set", f'model.path="{torn}"', "--set", f'train.out_dir="{torn}-run"')
    expect("export onto its source", ["would overwrite or contain the checkpoint"], "export", ckpt, ckpt)
    expect("export into its source", ["would overwrite or contain the checkpoint"],
           "export", ckpt, os.path.join(ckpt, "model"))


def hf_cases(ckpt):
    sharded = os.path.join(WORK, "hf-sharded")
    subprocess.run([FSDPP, "export", ckpt, sharded, "--max-shard-mb", "0.01"], check=True, capture_output=True)
    plan = lambda path: ("plan", CONFIG, "--set", f'model.path="{path}"')  # noqa: E731
    train = lambda path: ("train", CONFIG, "--set", f'model.path="{path}"', "--set",  # noqa: E731
                          f'train.out_dir="{WORK}/hf-run"', "--set", "train.steps=1")

    def hf_copy(name, change):
        out = os.path.join(WORK, name)
        shutil.copytree(sharded, out)
        change(out)
        return out

    def edit_index(d, value):
        path = os.path.join(d, "model.safetensors.index.json")
        index = json.load(open(path))
        index["weight_map"][next(iter(index["weight_map"]))] = value
        json.dump(index, open(path, "w"))

    expect("index naming ../", ["weight_map", "outside"], *train(hf_copy("index-up", lambda d: edit_index(d, "../x"))))
    expect("index naming /etc/passwd", ["weight_map", "outside"],
           *train(hf_copy("index-abs", lambda d: edit_index(d, "/etc/passwd"))))

    # The hub's download cache links every file of a snapshot to its blob: such a model trains,
    # and a link to what is not a weight file is read as the corrupt file it is.
    def hub_cache_layout(d):
        blobs = os.path.join(d, "blobs")
        os.mkdir(blobs)
        for i, f in enumerate(sorted(os.listdir(d))):
            if f != "blobs":
                os.rename(os.path.join(d, f), os.path.join(blobs, f"blob{i}"))
                os.symlink(os.path.join("blobs", f"blob{i}"), os.path.join(d, f))

    global failures
    linked = fsdpp("train", CONFIG, "--set", f'model.path="{hf_copy("hub-cache", hub_cache_layout)}"', "--set",
                   f'train.out_dir="{WORK}/hub-run"', "--set", "train.steps=1")
    ok = linked is not None and linked.returncode == 0
    failures += not ok
    print(f"{'ok  ' if ok else 'FAIL'} a model whose files all link to blobs trains" +
          ("" if ok else f": {linked.stderr.strip()[-600:] if linked else 'no end'}"))

    def link_shard(d):
        shard = sorted(f for f in os.listdir(d) if f.endswith(".safetensors"))[0]
        os.remove(os.path.join(d, shard))
        os.symlink("/etc/passwd", os.path.join(d, shard))

    expect("index shard a link to a text file", ["model-00001-of-", "corrupt safetensors header"],
           *train(hf_copy("index-link", link_shard)))

    def dangling_shard(d):
        shard = sorted(f for f in os.listdir(d) if f.endswith(".safetensors"))[0]
        os.remove(os.path.join(d, shard))
        os.symlink("gone.blob", os.path.join(d, shard))

    expect("index shard a dangling link", ["a link to gone.blob, which does not exist"],
           *train(hf_copy("dangling-shard", dangling_shard)))

    # Weights that are there but unusable never leave the model to random initialisation.
    def only(*keep):
        def change(d):
            for f in os.listdir(d):
                if f not in keep:
                    os.remove(os.path.join(d, f))
        return change

    def empty_single(d):
        only("config.json")(d)
        header = json.dumps({"__metadata__": {"format": "pt"}}).encode()
        with open(os.path.join(d, "model.safetensors"), "wb") as f:
            f.write(struct.pack("<Q", len(header)) + header)

    def empty_map(d):
        path = os.path.join(d, "model.safetensors.index.json")
        json.dump({"metadata": {}, "weight_map": {}}, open(path, "w"))

    def shards_without_index(d):
        os.remove(os.path.join(d, "model.safetensors.index.json"))

    def dangling_single(d):
        only("config.json")(d)
        os.symlink("gone.blob", os.path.join(d, "model.safetensors"))

    # Files whose tensors all have other names: the one missing tensor is the error, with no
    # line of warnings about the unused ones before it.
    def renamed(d):
        tensors = {}
        for f in os.listdir(d):
            if f.endswith(".safetensors"):
                tensors.update({"base." + k: v for k, v in load_file(os.path.join(d, f)).items()})
        only("config.json")(d)
        save_file(tensors, os.path.join(d, "model.safetensors"))

    renamed_dir = hf_copy("renamed", renamed)
    expect("every tensor named otherwise, in eval", ["model.safetensors", "model.embed_tokens.weight"],
           "eval", CONFIG, "--set", f'model.path="{renamed_dir}"')
    warned = fsdpp("eval", CONFIG, "--set", f'model.path="{renamed_dir}"')
    ok = warned is not None and " warning " not in warned.stderr
    failures += not ok
    print(f"{'ok  ' if ok else 'FAIL'} no warnings before that error" + ("" if ok else f": {warned.stderr[-600:]}"))
    expect("model.safetensors of no tensors", ["model.safetensors: holds no tensors"],
           *train(hf_copy("empty-single", empty_single)))
    expect("an index of no tensors", ["model.safetensors.index.json: its weight_map names no tensors"],
           *train(hf_copy("empty-map", empty_map)))
    expect("shards without their index", ["holds model-0000", "but neither model.safetensors nor"],
           *train(hf_copy("no-index", shards_without_index)))
    # A download or copy that left the weights out would otherwise start from random ones.
    def download_without_weights(d):
        only("config.json")(d)
        for f in ("tokenizer.json", "generation_config.json"):
            with open(os.path.join(d, f), "w") as out:
                out.write("{}")

    expect("a model directory of config.json and a tokenizer, without weights",
           ["holds no weights", "generation_config.json, tokenizer.json beside config.json",
            "left out of a download or a copy"], *train(hf_copy("no-weights", download_without_weights)))
    # Which set holds the model is ambiguous where a single file lies beside an index of shards
    # (transformers would read the single file); an index naming that file alone is one set.
    def stale_single(d):
        tensors = {}
        for f in os.listdir(d):
            if f.endswith(".safetensors"):
                tensors.update(load_file(os.path.join(d, f)))
        save_file(tensors, os.path.join(d, "model.safetensors"))

    expect("model.safetensors beside an index of shards",
           ["holds both model.safetensors and model.safetensors.index.json", "remove whichever set is stale"],
           *train(hf_copy("stale-single", stale_single)))

    def index_of_single(d):
        stale_single(d)
        path = os.path.join(d, "model.safetensors.index.json")
        index = json.load(open(path))
        index["weight_map"] = {name: "model.safetensors" for name in index["weight_map"]}
        json.dump(index, open(path, "w"))

    # A head tied by config.json to the embedding: transformers unties copies of other values.
    def tie(d, head_value):
        path = os.path.join(d, "config.json")
        cfg = json.load(open(path))
        cfg["tie_word_embeddings"] = True
        json.dump(cfg, open(path, "w"))
        if head_value is None:
            return
        tensors = load_file(os.path.join(d, "model.safetensors"))
        tensors["lm_head.weight"] = head_value(tensors["model.embed_tokens.weight"])
        save_file(tensors, os.path.join(d, "model.safetensors"))

    expect("a tied head whose file holds another head", ["holds 'model.embed_tokens.weight' and 'lm_head.weight' "
                                                         "of different values, but config.json ties them"],
           "eval", CONFIG, "--set", f'model.path="{hf_copy("tied-other", lambda d: tie(d, None))}"')
    def tied_copy(d):
        stale_single(d)
        only("config.json", "model.safetensors")(d)
        tie(d, lambda embedding: embedding.clone())

    for name, change in [("an index of model.safetensors alone beside it", index_of_single),
                         ("a tied head stored as a copy of the embedding", tied_copy)]:
        loaded = fsdpp("eval", CONFIG, "--set", f'model.path="{hf_copy(name.replace(" ", "-"), change)}"')
        ok = loaded is not None and loaded.returncode == 0 and " warning " not in loaded.stderr
        failures += not ok
        print(f"{'ok  ' if ok else 'FAIL'} {name} loads" + ("" if ok else f": {loaded.stderr[-600:] if loaded else 'no end'}"))
    # Tensors of layers config.json does not have: transformers' warning, on one line.
    def extra_layer(d):
        tensors = {}
        for f in os.listdir(d):
            if f.endswith(".safetensors"):
                tensors.update(load_file(os.path.join(d, f)))
        only("config.json")(d)
        tensors.update({k.replace("layers.0.", "layers.7."): v.clone() for k, v in tensors.items() if "layers.0." in k})
        save_file(tensors, os.path.join(d, "model.safetensors"))

    extra = fsdpp("eval", CONFIG, "--set", f'model.path="{hf_copy("extra-layer", extra_layer)}"')
    warnings = [l for l in extra.stderr.splitlines() if " warning " in l] if extra else []
    ok = extra is not None and extra.returncode == 0 and len(warnings) == 1 and \
        "9 tensor(s) the model does not use: 'model.layers.7." in warnings[0] and "and 6 more" in warnings[0]
    failures += not ok
    print(f"{'ok  ' if ok else 'FAIL'} tensors the model does not use, warned of on one line: " +
          (warnings[0] if len(warnings) == 1 else extra.stderr[-600:] if extra else "no end"))
    # Weights fsdpp cannot read, and a config.json path beside weights, would each start the
    # model from random weights where trained ones were meant.
    def pickled_weights(d):
        only("config.json")(d)
        torch.save({"model.embed_tokens.weight": torch.zeros(2)}, os.path.join(d, "pytorch_model.bin"))
        torch.save({"lr": 1.0}, os.path.join(d, "training_args.bin"))

    expect("weights in PyTorch's pickle format", ["pytorch_model.bin in a format fsdpp does not read", "to safetensors"],
           *train(hf_copy("pickled", pickled_weights)))
    beside = hf_copy("config-beside", lambda d: None)
    expect("a config.json path beside the weights",
           [f"{beside}/config.json: a config.json path starts the model afresh, but the weights "
            "model.safetensors.index.json lie beside it", f"name the directory {beside}"],
           "eval", CONFIG, "--set", f'model.path="{beside}/config.json"')
    expect("model.safetensors a dangling link", ["model.safetensors: a link to gone.blob, which does not exist"],
           *train(hf_copy("dangling-single", dangling_single)))

    def fifo_weights(d):
        for f in os.listdir(d):
            if f.endswith(".safetensors") or f.endswith(".json") and f != "config.json":
                os.remove(os.path.join(d, f))
        os.mkfifo(os.path.join(d, "model.safetensors"))

    expect("FIFO as model.safetensors", ["model.safetensors: not a regular file"], *train(hf_copy("fifo", fifo_weights)))

    def wrapping_shape(d):
        for f in os.listdir(d):
            if f != "config.json":
                os.remove(os.path.join(d, f))
        header = json.dumps({"lm_head.weight": {"dtype": "F32", "shape": [2**32, 2**32, 16], "data_offsets": [0, 0]}})
        with open(os.path.join(d, "model.safetensors"), "wb") as f:
            f.write(struct.pack("<Q", len(header)) + header.encode())

    expect("safetensors shape whose size wraps", ["model.safetensors: tensor 'lm_head.weight': shape",
                                                  "holds more elements than any file can"],
           *train(hf_copy("wrapping-shape", wrapping_shape)))

    def config(name, **changes):
        def change(d):
            path = os.path.join(d, "config.json")
            cfg = json.load(open(path))
            cfg.update(changes)
            json.dump(cfg, open(path, "w"))
        return hf_copy(name, change)

    for name, patterns, changes in [
        ("2.5 layers", ["num_hidden_layers must be an integer, got 2.5"], {"num_hidden_layers": 2.5}),
        ("a million layers", ["num_hidden_layers must be in [1, 4096], got 1000000"], {"num_hidden_layers": 1000000}),
        ("rope_theta 0", ["rope_theta must be above 1 and at most 1e300, got 0.0"], {"rope_theta": 0}),
        ("negative rms_norm_eps", ["rms_norm_eps must be positive"], {"rms_norm_eps": -1}),
        ("no positions", ["max_position_embeddings must be in [1,"], {"max_position_embeddings": 0}),
        ("garbage rope_scaling", ["rope_scaling: rope_type 'garbage' is not supported"],
         {"rope_scaling": {"rope_type": "garbage"}}),
        # Two versions' names of one field, or two places of one value, that disagree.
        ("dtype against torch_dtype", ['dtype "float32" and torch_dtype "bfloat16" disagree'],
         {"dtype": "float32", "torch_dtype": "bfloat16"}),
        ("rope_theta in two places", ["rope_theta 10000.0 and rope_parameters.rope_theta 500000.0 disagree"],
         {"rope_theta": 10000.0, "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}}),
        ("a sliding layer", ["layer_types[1] 'sliding_attention' is not supported"],
         {"layer_types": ["full_attention", "sliding_attention"]}),
        ("absurd width", ["describes a model of about", "more than the 1000B"],
         {"hidden_size": 2**20, "intermediate_size": 2**20, "num_attention_heads": 1024, "num_key_value_heads": 1024,
          "head_dim": 1024, "num_hidden_layers": 4096}),
    ]:
        expect(f"config.json: {name}", ["config.json"] + patterns, *plan(config(name.replace(" ", "-"), **changes)))


def token_case():
    path = os.path.join(WORK, "beyond-vocab.tok")
    tokens = list(range(300)) * 20  # the header says 256
    with open(path, "wb") as f:
        f.write(b"FSDPTOK\x00" + struct.pack("<IIQQ", 1, 2, len(tokens), 256) + struct.pack(f"<{len(tokens)}H", *tokens))
    expect("token beyond the header's vocabulary", ["beyond-vocab.tok: the token at position 256 is 256", "outside the header's vocabulary of 256"],
           "train", CONFIG, "--set", f'data.train="{path}"', "--set", f'train.out_dir="{WORK}/tok-run"',
           "--set", "data.shuffle=false")


def multimodal_cases():
    base = os.path.join(WORK, "mm")
    model = "tests/assets/models/tiny-qwen2-vl"
    image_2x2 = {"pixels": "x", "grid": [1, 2, 2]}  # one merged patch group: one placeholder
    for name, sample, pattern, sets in [
        ("input_ids 1.5", {"input_ids": [1, 1.5, 2]}, "samples.jsonl:1: input_ids must hold integers, not 1.5", []),
        ("negative grid", {"input_ids": [1, 2, 3], "images": [{"pixels": "x", "grid": [1, -4, 4]}]},
         "samples.jsonl:1: image grid must be [t, h, w] of sizes in [1, 65536]", []),
        # Of 41 tokens at seq_len 40, the last is a target alone: its placeholder no input.
        ("a placeholder as the 41st of 41 tokens", {"input_ids": [1] * 39 + [292, 290], "images": [image_2x2]},
         "samples.jsonl:1: its last token, the data.seq_len + 1 = 41th, is a placeholder", []),
        # Two images whose placeholders run together: the model fills each run with one image.
        ("two images in one run of placeholders", {"input_ids": [1, 292, 290, 290, 293, 2],
                                                   "images": [image_2x2, image_2x2]},
         "samples.jsonl:1: the image placeholders lie in runs of [2] tokens, but the images' grids give [1,1]: one run "
         "each, in their order", []),
        ("eval_fraction that holds out no sample", {"input_ids": [1, 2, 3]},
         "samples.jsonl: [data] eval_fraction 0.5 holds out 0 of its 1 samples", ["data.eval_fraction=0.5"]),
    ]:
        d = os.path.join(base, name.replace(" ", "-"))
        os.makedirs(d)
        save_file({"x": torch.zeros(4, 3 * 2 * 4 * 4)}, os.path.join(d, "pixels.safetensors"))
        with open(os.path.join(d, "samples.jsonl"), "w") as f:
            f.write(json.dumps(sample) + "\n")
        expect(f"samples.jsonl: {name}", [pattern],
               "train", CONFIG, "--set", f'model.path="{model}"', "--set", f'data.train="{d}"',
               "--set", f'train.out_dir="{WORK}/mm-run"', "--set", "data.seq_len=40", "--set", "data.batch_size=1",
               *[a for s in sets for a in ("--set", s)])


def main():
    subprocess.run(["bash", "scripts/make_corpus.sh"], check=True, capture_output=True)
    shutil.rmtree(WORK, ignore_errors=True)
    os.makedirs(WORK)
    run = os.path.join(WORK, "run")
    subprocess.run([FSDPP, "launch", "--nproc-per-node", "2", "--", "train", CONFIG, "--set", f'train.out_dir="{run}"',
                    "--set", "train.steps=2"], check=True, capture_output=True, timeout=300)
    ckpt = os.path.join(run, "checkpoints", "step-00000002")
    checkpoint_cases(ckpt)
    expect("a checkpoint without adapters as the base of adapters",
           [f"{ckpt}: a checkpoint of a run without adapters, as the base of adapters; export it"],
           "train", CONFIG, "--set", f'model.path="{ckpt}"', "--set", "policy.options.lora_rank=2",
           "--set", f'train.out_dir="{WORK}/lora-over-checkpoint"')
    hf_cases(ckpt)
    token_case()
    multimodal_cases()
    print(f"{failures} hostile file case(s) failed" if failures else "every hostile file is refused with one line")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
