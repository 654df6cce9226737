#!/usr/bin/env python3
"""Checkpoint save and load throughput per rank: fsdpp against PyTorch's distributed checkpoint
(torch.distributed.checkpoint, "DCP") on the same Llama model, with the disk's own sequential
write and read speed as the ceiling both are measured against.

Run with the project venv from the repository root (data/licenses.tok comes from
`bash scripts/make_corpus.sh`):

    .venv/bin/python scripts/bench_checkpoint.py [--world 2] [--hidden 512 --layers 8 --vocab 32000]
                                                [--work DIR] [--smoke]

All in one run, in a work directory (a fresh one under /tmp unless --work names one):

1. An HF Llama directory, a config.json and the weights transformers initialises from it,
   which both engines start from, and a TOML run file training it at batch size = world, one
   thread per rank.
2. Disk baseline: a file the size of one rank's share of the checkpoint (at least 256 MiB,
   but for --smoke) is written with os.write in 16 MiB chunks and fsync'd (timed together),
   evicted from the page cache with posix_fadvise(DONTNEED) and read back in 16 MiB chunks
   (timed).
3. fsdpp save: `fsdpp launch` trains one step and saves a final checkpoint; the engine's own
   log line gives the total bytes and the slowest rank's bytes, seconds and GB/s (each rank
   timed from the start of the save to the fsync'd commit of its own file).
4. fsdpp load: every file of that checkpoint is evicted from the page cache, then a second
   launch resumes from it and trains one more step; each rank logs the tensor bytes it read
   and the seconds spent reading them (checksum verification included). The slowest rank is
   reported.
5. DCP: the same model loaded with transformers' LlamaForCausalLM and sharded with
   fully_shard (FSDP2) over gloo as scripts/bench_fsdp.py shards it, AdamW after one step
   so its moments exist; dcp.save of get_state_dict(model, optimizer) is timed on
   each rank between barriers (FileSystemWriter fsyncs its files), the files are evicted from
   the page cache, and dcp.load plus set_state_dict into the same state dicts is timed. A
   rank's bytes are the size of the data files it wrote (__<rank>_*.distcp), which are also
   what it reads back at the same world size; the slowest rank is reported.

GB/s means 10^9 bytes per second, as the engine logs it. The page-cache evictions only make
the loads read from the device where the work directory is on a real disk, not on tmpfs.
"""
import argparse
import json
import math
import os
import re
import shutil
import sys
import tempfile
import time

from bench_common import BenchError, fail, parse_args, read_toml, write_initial_model
from fsdp_peer import build_sharded_model
from rank_processes import free_port, start, telling_line

PROG = "bench_checkpoint"
CHUNK = 16 << 20
MIN_DISK_BYTES = 256 << 20
SMOKE_MODEL = {"hidden": 64, "layers": 2, "vocab": 256}  # the bytes of data/licenses.tok must fit the vocabulary
POLL_S = 0.1

NUM = r"([0-9.]+(?:[eE][-+]?[0-9]+)?)"
SAVE_LINE = re.compile(r"checkpoint: step (\d+) saved to (.+?) in " + NUM + r" s: (\d+) bytes from (\d+) rank\(s\); "
                       r"slowest rank (\d+) wrote (\d+) bytes in " + NUM + r" s \(" + NUM + r" GB/s\)")
LOAD_LINE = re.compile(r"resume: rank (\d+) read (\d+) bytes of (.+?) \(saved at world (\d+)\) in "
                       + NUM + r" s \(" + NUM + r" GB/s; ")


# ---------------------------------------------------------------- model and run files


def intermediate_size(hidden):
    return max(8, round(2.7 * hidden / 8) * 8)


def hf_config(args):
    heads = args.hidden // 64
    return {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": args.hidden,
        "intermediate_size": intermediate_size(args.hidden),
        "num_hidden_layers": args.layers,
        "num_attention_heads": heads,
        "num_key_value_heads": args.kv_heads or heads,
        "vocab_size": args.vocab,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "initializer_range": 0.02,
        "torch_dtype": "float32",
    }


def run_toml(model_dir, data, seq_len, world):
    q = json.dumps  # a JSON string is a valid TOML basic string
    return f"""# Written by scripts/bench_checkpoint.py: a fresh Llama trained one step per run.
[model]
path = {q(model_dir)}
init_seed = 0

[data]
train = {q(data)}
seq_len = {seq_len}
batch_size = {world}
seed = 0

[optimizer]
lr = 1e-3
weight_decay = 0.1

[scheduler]
kind = "constant"
warmup_steps = 0

[train]
steps = 1
log_every = 1
eval_every = 0
threads = 1

[metrics]
progress = "never"
"""


# ---------------------------------------------------------------- page cache and disk


def evict(path):
    """Drops `path`'s pages from the page cache (they must be clean: os.sync() first)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def evict_tree(root):
    os.sync()
    for dirpath, _, names in os.walk(root):
        for name in names:
            evict(os.path.join(dirpath, name))


def filesystem_type(path):
    path, best, kind = os.path.realpath(path), "", "?"
    with open("/proc/mounts") as f:
        for line in f:
            fields = line.split()
            mount = fields[1].replace("\\040", " ")
            inside = path == mount or path.startswith(mount.rstrip("/") + "/")
            if inside and len(mount) >= len(best):
                best, kind = mount, fields[2]
    return kind


def disk_baseline(path, size):
    """Sequential write (fsync included) then cold read of `size` bytes; both in seconds."""
    chunk = os.urandom(CHUNK)
    count = math.ceil(size / CHUNK)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        begin = time.perf_counter()
        for _ in range(count):
            view = memoryview(chunk)
            while view:
                view = view[os.write(fd, view):]
        os.fsync(fd)
        write_s = time.perf_counter() - begin
    finally:
        os.close(fd)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        buf, read = bytearray(CHUNK), 0
        begin = time.perf_counter()
        while True:
            n = os.readv(fd, [buf])
            if n == 0:
                break
            read += n
        read_s = time.perf_counter() - begin
    finally:
        os.close(fd)
        os.unlink(path)
    if read != count * CHUNK:
        raise BenchError(f"{path}: read back {read} of {count * CHUNK} bytes")
    return count * CHUNK, write_s, read_s


# ---------------------------------------------------------------- fsdpp


def run_fsdpp(args, run_file, log, sets):
    cmd = [args.fsdpp, "launch", "--nproc-per-node", str(args.world), "--", "train", run_file]
    for s in sets:
        cmd += ["--set", s]
    code = start(cmd, log).wait()
    if code != 0:
        raise BenchError(f"fsdpp exited with status {code}: {telling_line(log)} (log: {log})")
    with open(log, errors="replace") as f:
        return f.read().splitlines()


def fsdpp_save(args, run_file, work):
    q = json.dumps
    log = os.path.join(work, "fsdpp-save.log")
    lines = run_fsdpp(args, run_file, log, [
        "train.steps=1", "checkpoint.save_final=true",
        f"checkpoint.dir={q(os.path.join(work, 'fsdpp', 'checkpoints'))}",
        f"train.out_dir={q(os.path.join(work, 'fsdpp', 'save'))}", 'metrics.progress="never"'])
    found = [m for m in map(SAVE_LINE.search, lines) if m]
    if len(found) != 1:
        raise BenchError(f"expected one 'checkpoint: ... saved to' line in {log}, found {len(found)}")
    m = found[0]
    step_dir, total, ranks = m.group(2), int(m.group(4)), int(m.group(5))
    if ranks != args.world:
        raise BenchError(f"{log}: checkpoint saved by {ranks} rank(s), not {args.world}")
    if not os.path.isfile(os.path.join(step_dir, "metadata.json")):
        raise BenchError(f"{step_dir} has no metadata.json")
    with open(os.path.join(step_dir, "metadata.json")) as f:
        files = json.load(f).get("files", {})
    per_rank = [files.get(f"rank-{r:05d}.safetensors", {}).get("bytes") for r in range(args.world)]
    if None in per_rank or sum(per_rank) != total:
        raise BenchError(f"{step_dir}/metadata.json: rank files {per_rank} do not add up to the "
                         f"{total} bytes logged")
    return {"dir": step_dir, "total": total, "per_rank": per_rank, "slowest_bytes": int(m.group(7)),
            "seconds": float(m.group(8)), "gbps": float(m.group(9))}


def fsdpp_load(args, run_file, work, step_dir):
    q = json.dumps
    log = os.path.join(work, "fsdpp-load.log")
    lines = run_fsdpp(args, run_file, log, [
        f"checkpoint.resume={q(step_dir)}", "train.steps=2", "checkpoint.save_final=false",
        f"checkpoint.dir={q(os.path.join(work, 'fsdpp', 'checkpoints'))}",
        f"train.out_dir={q(os.path.join(work, 'fsdpp', 'load'))}", 'metrics.progress="never"'])
    ranks = {}
    for m in filter(None, map(LOAD_LINE.search, lines)):
        rank = int(m.group(1))
        if int(m.group(4)) != args.world:
            raise BenchError(f"{log}: rank {rank} resumed a checkpoint saved at world {m.group(4)}")
        ranks[rank] = {"bytes": int(m.group(2)), "seconds": float(m.group(5)), "gbps": float(m.group(6))}
    if sorted(ranks) != list(range(args.world)):
        raise BenchError(f"{log}: 'resume: rank N read' lines for ranks {sorted(ranks)}, "
                         f"expected 0..{args.world - 1}")
    return ranks


# ---------------------------------------------------------------- PyTorch DCP


def run_dcp(args, run_file, work):
    ckpt = os.path.join(work, "dcp", "checkpoint")
    port = free_port()
    procs, logs, results = [], [], []
    for rank in range(args.world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(args.world), LOCAL_RANK=str(rank),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        logs.append(os.path.join(work, f"dcp-rank{rank}.log"))
        results.append(os.path.join(work, "dcp", f"rank{rank}.json"))
        cmd = [sys.executable, os.path.abspath(__file__), "--dcp-worker", "--run", run_file,
               "--dcp-dir", ckpt, "--result", results[-1]]
        procs.append(start(cmd, logs[-1], env))
    while True:
        codes = [p.poll() for p in procs]
        bad = [i for i, c in enumerate(codes) if c not in (None, 0)]
        if bad:
            # A surviving rank would wait in a collective forever.
            for p in procs:
                if p.poll() is None:
                    p.terminate()
            for p in procs:
                p.wait()
            i = bad[0]
            raise BenchError(f"DCP rank {i} exited with status {codes[i]}: {telling_line(logs[i])} "
                             f"(log: {logs[i]})")
        if all(c == 0 for c in codes):
            break
        time.sleep(POLL_S)
    ranks = {}
    for rank, path in enumerate(results):
        with open(path) as f:
            ranks[rank] = json.load(f)
    return ranks


def dcp_worker(args):
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    cfg = read_toml(args.run)
    dist.init_process_group("gloo")
    try:
        model = build_sharded_model(cfg, world, cfg["model"]["path"], "cpu", None)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
        seq_len = int(cfg["data"]["seq_len"])
        ids = torch.randint(0, model.config.vocab_size, (1, seq_len),
                            generator=torch.Generator().manual_seed(rank))
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        model_sd, optim_sd = get_state_dict(model, opt)
        state = {"model": model_sd, "optim": optim_sd}

        dist.barrier()
        begin = time.perf_counter()
        dcp.save(state, checkpoint_id=args.dcp_dir)
        save_s = time.perf_counter() - begin
        dist.barrier()
        if rank == 0:
            evict_tree(args.dcp_dir)
        dist.barrier()
        begin = time.perf_counter()
        dcp.load(state, checkpoint_id=args.dcp_dir)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        load_s = time.perf_counter() - begin
        dist.barrier()

        mine = [n for n in os.listdir(args.dcp_dir) if n.startswith(f"__{rank}_") and n.endswith(".distcp")]
        file_bytes = sum(os.path.getsize(os.path.join(args.dcp_dir, n)) for n in mine)
        with open(args.result, "w") as f:
            json.dump({"bytes": file_bytes, "save_s": save_s, "load_s": load_s,
                       "save_gbps": file_bytes / save_s / 1e9, "load_gbps": file_bytes / load_s / 1e9}, f)
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------- benchmark


def bench(args):
    if not (os.path.isfile(args.fsdpp) and os.access(args.fsdpp, os.X_OK)):
        raise BenchError(f"fsdpp binary {args.fsdpp} not found or not executable; build it first "
                         "or pass --fsdpp")
    if args.world < 1:
        raise BenchError("--world must be at least 1")
    if args.hidden < 64 or args.hidden % 64:
        raise BenchError("--hidden must be a positive multiple of 64 (heads of 64)")
    if args.layers < 1 or args.vocab < 1 or args.seq_len < 1:
        raise BenchError("--layers, --vocab and --seq-len must be positive")
    if args.kv_heads < 0 or (args.kv_heads and (args.hidden // 64) % args.kv_heads):
        raise BenchError(f"--kv-heads must divide the {args.hidden // 64} attention heads")
    data = os.path.abspath(args.data)
    if not os.path.isfile(data):
        raise BenchError(f"token file {args.data} not found (bash scripts/make_corpus.sh builds it)")

    own_work = args.work is None
    work = os.path.abspath(args.work or tempfile.mkdtemp(prefix="fsdpp-bench-checkpoint-"))
    os.makedirs(work, exist_ok=True)
    for stale in ("fsdpp", "dcp", "model"):  # a reused --work starts clean
        shutil.rmtree(os.path.join(work, stale), ignore_errors=True)
    os.makedirs(os.path.join(work, "dcp"))
    model_dir = os.path.join(work, "model")
    os.makedirs(model_dir)
    config = hf_config(args)
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    run_file = os.path.join(work, "run.toml")
    with open(run_file, "w") as f:
        f.write(run_toml(model_dir, data, args.seq_len, args.world))
    _, params, _ = write_initial_model(read_toml(run_file), model_dir)

    share = params * 4 * 3 // args.world  # weights and two AdamW moments, float32
    fs_kind = filesystem_type(work)
    print(f"model: hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}, "
          f"intermediate {config['intermediate_size']}, {params / 1e6:.1f}M parameters; world "
          f"{args.world}; work dir {work} ({fs_kind})", flush=True)
    if fs_kind in ("tmpfs", "ramfs"):
        print(f"warning: {work} is on {fs_kind}; every number below measures memory, not a disk",
              file=sys.stderr)

    rows = {}
    print("disk baseline...", flush=True)
    # The floor steadies a measurement; a smoke run needs only its code path.
    size, write_s, read_s = disk_baseline(os.path.join(work, "disk-baseline.bin"),
                                          share if args.smoke else max(MIN_DISK_BYTES, share))
    rows["disk sequential write"] = (size / write_s / 1e9, size, write_s)
    rows["disk sequential read"] = (size / read_s / 1e9, size, read_s)

    print("fsdpp save...", flush=True)
    save = fsdpp_save(args, run_file, work)
    rows["fsdpp save"] = (save["gbps"], save["slowest_bytes"], save["seconds"])  # all three of the slowest rank
    evict_tree(save["dir"])
    print("fsdpp load...", flush=True)
    load = fsdpp_load(args, run_file, work, save["dir"])
    slow = min(load.values(), key=lambda r: r["gbps"])
    rows["fsdpp load"] = (slow["gbps"], slow["bytes"], slow["seconds"])

    print("PyTorch DCP save and load...", flush=True)
    dcp = run_dcp(args, run_file, work)
    for op in ("save", "load"):
        slow = min(dcp.values(), key=lambda r: r[f"{op}_gbps"])
        rows[f"DCP {op}"] = (slow[f"{op}_gbps"], slow["bytes"], slow[f"{op}_s"])

    print()
    print("| operation | GB/s per rank (slowest) | bytes per rank | seconds |")
    print("|---|---:|---:|---:|")
    for name, (gbps, nbytes, seconds) in rows.items():
        print(f"| {name} | {gbps:.4f} | {nbytes:,} | {seconds:.4f} |")
    print()
    ratio = lambda a, b: rows[a][0] / rows[b][0]
    print("| ratio of GB/s per rank | save | load |")
    print("|---|---:|---:|")
    print(f"| fsdpp / DCP | {ratio('fsdpp save', 'DCP save'):.2f}x | {ratio('fsdpp load', 'DCP load'):.2f}x |")
    print(f"| fsdpp / disk | {ratio('fsdpp save', 'disk sequential write'):.2f}x | "
          f"{ratio('fsdpp load', 'disk sequential read'):.2f}x |")
    print(f"| DCP / disk | {ratio('DCP save', 'disk sequential write'):.2f}x | "
          f"{ratio('DCP load', 'disk sequential read'):.2f}x |")
    print()
    print("per rank: fsdpp saved " + ", ".join(f"r{r} {b:,} B" for r, b in enumerate(save["per_rank"]))
          + "; fsdpp read " + ", ".join(f"r{r} {v['bytes']:,} B in {v['seconds']:.4f} s"
                                        for r, v in sorted(load.items()))
          + "; DCP " + ", ".join(f"r{r} {v['bytes']:,} B saved in {v['save_s']:.4f} s, loaded in "
                                 f"{v['load_s']:.4f} s" for r, v in sorted(dcp.items())))
    if own_work and not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    else:
        print(f"work dir kept: {work}")


def main():
    ap = argparse.ArgumentParser(description="Checkpoint save and load GB/s per rank: fsdpp against "
                                 "PyTorch DCP on the same Llama, with the disk's sequential speed as "
                                 "the baseline. Run from the repository root.")
    ap.add_argument("--world", type=int, default=2, help="ranks for both engines (default: %(default)s)")
    ap.add_argument("--hidden", type=int, default=512, help="hidden size, a multiple of 64 (default: %(default)s)")
    ap.add_argument("--layers", type=int, default=8, help="decoder layers (default: %(default)s)")
    ap.add_argument("--vocab", type=int, default=32000, help="vocabulary size (default: %(default)s)")
    ap.add_argument("--kv-heads", type=int, default=0,
                    help="key/value heads (default: as many as attention heads, hidden / 64)")
    ap.add_argument("--seq-len", type=int, default=16, help="training sequence length (default: %(default)s)")
    ap.add_argument("--data", default="data/licenses.tok", help="token file (default: %(default)s)")
    ap.add_argument("--work", help="work directory (default: a new one under /tmp, removed on success)")
    ap.add_argument("--keep", action="store_true", help="keep the default work directory")
    ap.add_argument("--fsdpp", default="build/fsdpp", help="path to the fsdpp binary (default: %(default)s)")
    ap.add_argument("--smoke", action="store_true",
                    help="check the whole benchmark in seconds: a tiny model (" +
                    ", ".join(f"--{k} {v}" for k, v in SMOKE_MODEL.items()) +
                    " unless given) and a small disk baseline; its figures mean nothing")
    ap.add_argument("--dcp-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--run", help=argparse.SUPPRESS)
    ap.add_argument("--dcp-dir", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    ap.error = lambda msg: fail(PROG, msg)
    args = parse_args(ap, SMOKE_MODEL)
    try:
        if args.dcp_worker:
            dcp_worker(args)
        else:
            bench(args)
    except BenchError as e:
        fail(PROG, str(e))


if __name__ == "__main__":
    main()
