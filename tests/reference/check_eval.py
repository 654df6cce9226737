"""`fsdpp eval` against transformers: the mean next-token loss and perplexity of HF
checkpoints over consecutive non-overlapping windows of a token file must match what
transformers computes for the same model and windows (labels = input_ids per window)."""
import json
import math
import os
import struct
import subprocess
import sys
import tempfile

import torch
import transformers

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts"))
import cpu_cap  # noqa: E402

cpu_cap.apply()  # before any torch kernel runs

FSDPP = os.environ["FSDPP"]
FIXTURES = os.environ["FIXTURES"]
SEQ_LEN = 12
torch.set_num_threads(1)


def write_tokens(path, tokens, vocab):
    with open(path, "wb") as f:
        f.write(b"FSDPTOK\x00" + struct.pack("<IIQQ", 1, 2, len(tokens), vocab))
        f.write(struct.pack(f"<{len(tokens)}H", *tokens))


def hf_eval(model_dir, tokens):
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager")
    windows = len(tokens) // SEQ_LEN
    ids = torch.tensor(tokens[: windows * SEQ_LEN]).view(windows, SEQ_LEN)
    total = 0.0
    with torch.no_grad():
        for w in ids:
            out = model(input_ids=w[None], labels=w[None])
            total += out.loss.double().item() * (SEQ_LEN - 1)
    loss = total / (windows * (SEQ_LEN - 1))
    return windows, loss


def check_models(work):
    """Each fixture's eval against transformers' over one token file in `work`; the failures."""
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 101, (12 * 7 + 5,), generator=gen).tolist()  # 7 windows + a tail
    token_file = os.path.join(work, "eval.tok")
    write_tokens(token_file, tokens, 101)
    failures = 0
    for name in ["llama_tied_rope3", "qwen2", "qwen3"]:
        model_dir = os.path.join(FIXTURES, name)
        toml = os.path.join(work, f"{name}.toml")
        with open(toml, "w") as f:
            f.write(f'[model]\npath = "{model_dir}"\n[data]\ntrain = "{token_file}"\n'
                    f"seq_len = {SEQ_LEN}\nbatch_size = 3\n[train]\nthreads = 1\n")
        out = subprocess.run([FSDPP, "eval", toml, "--json"], capture_output=True, text=True)
        if out.returncode != 0:
            print(f"FAIL {name}: fsdpp eval exited {out.returncode}: {out.stderr.strip()}")
            failures += 1
            continue
        ours = json.loads(out.stdout.strip().splitlines()[-1])
        windows, loss = hf_eval(model_dir, tokens)
        rel = abs(ours["loss"] - loss) / loss
        ok = ours["windows"] == windows and rel < 1e-5 and abs(ours["perplexity"] - math.exp(loss)) / math.exp(loss) < 1e-5
        print(f"{'ok  ' if ok else 'FAIL'} {name}: fsdpp loss {ours['loss']:.8f} over {ours['windows']} windows, "
              f"transformers {loss:.8f} over {windows} (relative difference {rel:.2e})")
        failures += not ok
    return failures


def main():
    with tempfile.TemporaryDirectory(prefix="fsdpp-eval-") as work:
        failures = check_models(work)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
