"""Loading HF weights into shards: each rank reads only its own rows. A 52 MB Llama made by
transformers is trained 2 steps at world 4 and in one plain process; at world 4 every rank
must have touched about a quarter of the safetensors bytes (its resident pages of the mapped
files, read from /proc/self/smaps, which the engine logs), the four together about all of
them, and the losses must equal the one-process run's within 1e-5 relative. A tied Llama
(its file holds the embedding once), and Qwen3-MoE and DeepSeek-V3 models (one tensor per
expert projection) trained at world 3 must match one process too. Their resident pages are
printed but not checked: a rank's slice of a 128 KB expert tensor is smaller than the window
the kernel maps around each page fault (fault-around), which also maps pages the other ranks
brought into the page cache, so the count overstates what the rank itself read."""
import json
import os
import re
import shutil
import subprocess
import sys

import torch
import transformers

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from compare import max_relative  # noqa: E402
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts"))
import cpu_cap  # noqa: E402

cpu_cap.apply()  # before any torch kernel runs

FSDPP = os.environ["FSDPP"]
WORK = os.path.join(os.environ["WORK"], "sliced-load")
CONFIG = "tests/assets/fsdp-llama.toml"


def make_model(directory, vocab=8192, hidden=512, tied=False):
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                                      num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
                                      max_position_embeddings=64, tie_word_embeddings=tied)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(directory)


def make_moe_model(directory, family):
    """A MoE model as transformers saves it: every expert's projections its own tensors."""
    common = dict(vocab_size=2048, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                  num_attention_heads=4, max_position_embeddings=64, num_experts_per_tok=2,
                  moe_intermediate_size=128)
    if family == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(**common, num_key_value_heads=2, head_dim=64, num_experts=16)
        model = transformers.Qwen3MoeForCausalLM
    else:
        config = transformers.DeepseekV3Config(**common, num_key_value_heads=4, n_routed_experts=16, n_group=4,
                                               topk_group=2, first_k_dense_replace=1, q_lora_rank=64,
                                               kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16,
                                               v_head_dim=32)
        model = transformers.DeepseekV3ForCausalLM
    torch.manual_seed(0)
    model(config).save_pretrained(directory)


def evict(directory):
    """Drops the files' pages from the page cache, so each rank's reads start cold and its
    resident pages are the ones it faulted in itself."""
    os.sync()
    for name in os.listdir(directory):
        fd = os.open(os.path.join(directory, name), os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


def train(out_dir, model_dir, world):
    args = ["train", CONFIG, "--set", f'model.path="{model_dir}"', "--set", f'train.out_dir="{out_dir}"',
            "--set", "train.steps=2", "--set", "checkpoint.save_final=false", "--set", "data.seq_len=16"]
    cmd = [FSDPP] + args if world == 1 else [FSDPP, "launch", "--nproc-per-node", str(world), "--"] + args
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        sys.exit(f"FAIL: {' '.join(cmd)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    losses = [json.loads(l)["loss"] for l in open(os.path.join(out_dir, "metrics.jsonl")) if '"loss"' in l]
    return losses, proc.stderr


def main():
    subprocess.run(["bash", "scripts/make_corpus.sh"], check=True, capture_output=True)
    shutil.rmtree(WORK, ignore_errors=True)
    model_dir = os.path.join(WORK, "model")
    make_model(model_dir)
    ref, _ = train(os.path.join(WORK, "one"), model_dir, 1)
    evict(model_dir)
    losses, log = train(os.path.join(WORK, "four"), model_dir, 4)
    reads = {int(r): (int(a), int(b)) for r, a, b in
             re.findall(r"weights: rank (\d+) read (\d+) of (\d+) bytes", log)}
    total = next(iter(reads.values()))[1] if reads else 1
    shares = {r: a / total for r, (a, _) in sorted(reads.items())}
    together = sum(a for a, _ in reads.values()) / total
    loss_err = max_relative(losses, ref)
    ok = sorted(shares) == [0, 1, 2, 3] and all(0.22 <= s <= 0.30 for s in shares.values()) \
        and 0.98 <= together <= 1.15 and loss_err <= 1e-5 and len(losses) == len(ref) == 2
    print(f"{'ok  ' if ok else 'FAIL'} world 4 from a {total / 1e6:.1f} MB HF model: each rank read "
          + ", ".join(f"rank {r} {s:.1%}" for r, s in shares.items())
          + f" of the bytes ({together:.1%} together); losses vs one process {loss_err:.2e}")

    tied_dir = os.path.join(WORK, "tied")
    make_model(tied_dir, vocab=300, hidden=64, tied=True)
    ref, _ = train(os.path.join(WORK, "tied-one"), tied_dir, 1)
    losses, _ = train(os.path.join(WORK, "tied-three"), tied_dir, 3)
    tied_err = max_relative(losses, ref)
    tied_ok = tied_err <= 1e-5 and len(losses) == len(ref) == 2
    print(f"{'ok  ' if tied_ok else 'FAIL'} tied HF model at world 3: losses vs one process {tied_err:.2e}")

    moe_ok = True
    for family in ("qwen3_moe", "deepseek_v3"):
        moe_dir = os.path.join(WORK, family)
        make_moe_model(moe_dir, family)
        ref, _ = train(os.path.join(WORK, f"{family}-one"), moe_dir, 1)
        evict(moe_dir)
        losses, log = train(os.path.join(WORK, f"{family}-three"), moe_dir, 3)
        reads = [(int(a), int(b)) for a, b in re.findall(r"weights: rank \d+ read (\d+) of (\d+) bytes", log)]
        shares = [a / b for a, b in reads]
        err = max_relative(losses, ref)
        good = len(shares) == 3 and err <= 1e-5 and len(losses) == 2
        moe_ok &= good
        print(f"{'ok  ' if good else 'FAIL'} {family} HF model ({reads[0][1] / 1e6 if reads else 0:.1f} MB) at world 3: "
              f"losses vs one process {err:.2e}; resident pages per rank {', '.join(f'{s:.1%}' for s in shares)} "
              "(not a read measure here: see above)")
    sys.exit(0 if ok and tied_ok and moe_ok else 1)


if __name__ == "__main__":
    main()
