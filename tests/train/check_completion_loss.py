"""Chat data prepared with a Hugging Face chat template trains only the assistant turns:
scripts/prepare_data.py marks exactly those tokens (and each turn's end) and a Parquet row's
completion, refuses a bad record
with FILE:LINE or skips it with --skip-bad; fsdpp's first-step loss with train_on =
"completion" equals the mean cross entropy of transformers' model over the marked targets of
the same windows, as does `fsdpp eval`'s loss over its windows, and two ranks, or two accumulated micro-batches, equal one process. All in
float64: ranks and accumulation within tests/compare.py's FLOAT64_BOUND; transformers within
TRANSFORMERS_BOUND, as its rotary tables are computed in float32 whatever the model's dtype."""
import json
import os
import shutil
import struct
import subprocess
import sys

import pyarrow
import pyarrow.parquet
import torch
from tokenizers import Tokenizer, decoders, models
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
from compare import FLOAT64_BOUND  # noqa: E402

FSDPP = os.environ["FSDPP"]
FIXTURE = os.path.join(os.environ["FIXTURES"], "llama_untied")  # vocab 101
WORK = os.path.join(os.environ["WORK"], "completion-loss")
SEQ_LEN, BATCH = 24, 2
# float32 cos/sin tables (relative rounding 6e-8) reach the loss at about that size: measured
# 2.4e-8. A lost or misplaced mask moves the loss by 1e-2 and more.
TRANSFORMERS_BOUND = 1e-6
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CHATS = [
    [{"role": "user", "content": "hi there"}, {"role": "assistant", "content": "hello, how are you?"}],
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "sum 2 and 3"},
     {"role": "assistant", "content": "5"}, {"role": "user", "content": "and 4 and 4?"},
     {"role": "assistant", "content": "8, as always"}],
    [{"role": "user", "content": "name a colour"}, {"role": "assistant", "content": "blue like the sky"}],
]


def make_tokenizer(path):
    """A character-level tokenizer with a chat template, saved by transformers as a model's is."""
    chars = sorted(set("abcdefghijklmnopqrstuvwxyz0123456789 ,.?!\n"))
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = {c: i for i, c in enumerate(specials + chars)}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<|endoftext|>"))  # no merges: one token a character
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|endoftext|>",
                                  additional_special_tokens=specials[1:])
    tok.chat_template = TEMPLATE
    tok.save_pretrained(path)
    return tok


def read_token_file(path):
    data = open(path, "rb").read()
    magic, version, width, count, vocab, documents, flags, _ = struct.unpack_from("<8sIIQQQII", data)
    assert (magic, version, width, flags) == (b"FSDPTOK\x00", 2, 2, 1), (magic, version, width, flags)
    tokens = list(struct.unpack_from(f"<{count}H", data, 48))
    ends = list(struct.unpack_from(f"<{documents}Q", data, 48 + 2 * count))
    mask = list(data[48 + 2 * count + 8 * documents:])
    return tokens, ends, mask, vocab


def prepare(*args):
    return subprocess.run([sys.executable, "scripts/prepare_data.py", *args], capture_output=True, text=True)


def check_prepared(tok, data, out):
    """Refusal with FILE:LINE, --skip-bad, and a mask that marks the assistant turns alone."""
    refused = prepare(data, "--tokenizer", os.path.join(WORK, "tok"), "--out", out)
    assert refused.returncode == 2 and f"{data}:4: messages must be" in refused.stderr, refused.stderr
    rows = os.path.join(WORK, "rows.parquet")
    pyarrow.parquet.write_table(pyarrow.table({"prompt": ["the weather? "], "completion": ["a fine day"]}), rows)
    done = prepare(data, rows, "--tokenizer", os.path.join(WORK, "tok"), "--out", out, "--skip-bad")
    assert done.returncode == 0 and "skipped 1 bad records" in done.stdout, done.stdout + done.stderr
    tokens, ends, mask, vocab = read_token_file(out)
    assert vocab == len(tok) and len(ends) == len(CHATS) + 1 and ends[-1] == len(tokens) == len(mask)
    for chat, begin, end in zip(CHATS, [0] + ends, ends):
        learned = tok.decode([t for t, m in zip(tokens[begin:end], mask[begin:end]) if m])
        expected = "".join(m["content"] + "<|im_end|>\n" for m in chat if m["role"] == "assistant") + "<|endoftext|>"
        assert learned == expected, (learned, expected)
    completion = tok.decode([t for t, m in zip(tokens[ends[-2]:], mask[ends[-2]:]) if m])
    assert completion == "a fine day<|endoftext|>", completion
    return tokens, mask


def train(name, out, *sets, nproc=1):
    run_dir = os.path.join(WORK, name)
    config = os.path.join(WORK, "run.toml")
    args = ["train", config, "--set", f'train.out_dir="{run_dir}"', *[a for s in sets for a in ("--set", s)]]
    cmd = [FSDPP, *args] if nproc == 1 else [FSDPP, "launch", "--nproc-per-node", str(nproc), "--", *args]
    subprocess.run(cmd, check=True, capture_output=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [r["loss"] for r in map(json.loads, f) if "loss" in r and "eval_loss" not in r]


def gap(losses, reference):
    """The largest relative difference; a step whose windows hold no target (the second one
    here: a system prompt and a question) has loss 0 in both, exactly."""
    return max(abs(a - b) / abs(b) if b else (0.0 if a == 0 else float("inf")) for a, b in zip(losses, reference))


def masked_loss(inputs, targets, marks):
    """transformers' mean cross entropy over the marked targets: inputs and targets [B, T]."""
    model = AutoModelForCausalLM.from_pretrained(FIXTURE, dtype=torch.float64)
    with torch.no_grad():
        logits = model(inputs).logits
    labels = targets.masked_fill(~marks, -100)
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1),
                                             ignore_index=-100).item()


def first_step_reference(tokens, mask):
    """The first step's windows: BATCH windows of SEQ_LEN + 1 tokens from the start (no shuffle)."""
    ids, marks = torch.tensor(tokens), torch.tensor(mask).bool()
    windows = torch.stack([ids[w * SEQ_LEN:(w + 1) * SEQ_LEN + 1] for w in range(BATCH)])  # [B, T + 1]
    window_marks = torch.stack([marks[w * SEQ_LEN:(w + 1) * SEQ_LEN + 1] for w in range(BATCH)])
    return masked_loss(windows[:, :-1], windows[:, 1:], window_marks[:, 1:])


def eval_reference(tokens, mask):
    """`fsdpp eval`'s windows: consecutive SEQ_LEN tokens, each predicting its own tokens 2..SEQ_LEN."""
    n = len(tokens) // SEQ_LEN
    ids = torch.tensor(tokens[:n * SEQ_LEN]).view(n, SEQ_LEN)
    marks = torch.tensor(mask[:n * SEQ_LEN]).bool().view(n, SEQ_LEN)
    return masked_loss(ids[:, :-1], ids[:, 1:], marks[:, 1:])


def main():
    shutil.rmtree(WORK, ignore_errors=True)
    os.makedirs(WORK)
    tok = make_tokenizer(os.path.join(WORK, "tok"))
    data = os.path.join(WORK, "chats.jsonl")
    with open(data, "w") as f:
        for chat in CHATS[:2]:
            f.write(json.dumps({"messages": chat}) + "\n")
        f.write("\n" + json.dumps({"messages": "not a list"}) + "\n")
        f.write(json.dumps({"messages": CHATS[2]}) + "\n")
    out = os.path.join(WORK, "chats.tok")
    tokens, mask = check_prepared(tok, data, out)
    with open(os.path.join(WORK, "run.toml"), "w") as f:
        f.write(f'[model]\npath = "{FIXTURE}"\ndtype = "float64"\n'
                f'[data]\ntrain = "{out}"\nseq_len = {SEQ_LEN}\nbatch_size = {BATCH}\nshuffle = false\n'
                'train_on = "completion"\n[optimizer]\nlr = 1e-2\n[train]\nsteps = 3\n[checkpoint]\nsave_final = false\n')
    one = train("one", out)
    reference = first_step_reference(tokens, mask)
    evaluated = json.loads(subprocess.run([FSDPP, "eval", os.path.join(WORK, "run.toml"), "--json"], check=True,
                                          capture_output=True, text=True).stdout)
    gaps = {"first loss vs transformers": (gap(one[:1], [reference]), TRANSFORMERS_BOUND),
            "eval loss vs transformers": (gap([evaluated["loss"]], [eval_reference(tokens, mask)]), TRANSFORMERS_BOUND),
            "2 ranks vs 1": (gap(train("two", out, nproc=2), one), FLOAT64_BOUND),
            "2 micro-batches vs 1 batch": (gap(train("accum", out, "data.batch_size=1", "train.grad_accum=2"), one),
                                           FLOAT64_BOUND)}
    everything = train("all", out, 'data.train_on="all"')
    failed = [k for k, (value, bound) in gaps.items() if not value <= bound]
    for k, (value, bound) in gaps.items():
        print(f"{'FAIL' if k in failed else 'ok  '} {k}: {value:.2e} (bound {bound:.0e})")
    # Learning every token is a different objective: its loss must differ from the masked one.
    print(f"losses, completion {one[0]:.6f} vs all {everything[0]:.6f}; transformers {reference:.6f}")
    if failed or abs(everything[0] - one[0]) < 1e-3:
        sys.exit(1)


if __name__ == "__main__":
    main()
