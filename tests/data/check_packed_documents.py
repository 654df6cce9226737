"""From chat JSONL to packed training, held to transformers. scripts/prepare_data.py marks
exactly the assistant turns (and each turn's end) of chats rendered by a Hugging Face chat
template, and a Parquet row's completion; under a template that rewrites earlier turns it
writes a document per assistant turn, rendered as transformers renders it; it refuses a line that is not JSON, a chat without
an assistant turn and a malformed one with FILE:LINE, or skips them with --skip-bad. fsdpp
packs the documents into rows (best fit, longest first, long ones cut into pieces) where
attention stays inside each document: its first-step loss with train_on = "completion"
equals transformers' mean cross entropy over the marked targets of each piece run alone (and
its `targets` figure their count), and so does `fsdpp eval`'s; 2 and 3 ranks, two accumulated micro-batches and a resume mid-epoch
(in file order and shuffled) equal one uninterrupted process, and so do held-out losses at
2 ranks; packing = false refuses a document longer than a row. All
in float64: ranks, accumulation and resume within tests/compare.py's FLOAT64_BOUND;
transformers within TRANSFORMERS_BOUND, as its rotary tables are computed in float32 whatever
the model's dtype."""
import json
import os
import shutil
import subprocess
import sys

import pyarrow
import pyarrow.parquet
import torch
from transformers import AutoModelForCausalLM

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, TESTS)
sys.path.insert(0, os.path.join(os.path.dirname(TESTS), "scripts"))
from compare import FLOAT64_BOUND  # noqa: E402
from make_sft_example import make_tokenizer  # noqa: E402  (one token a character, a chat template)
from packed_rows import best_fit, pieces, read_token_file  # noqa: E402

FSDPP = os.environ["FSDPP"]
FIXTURE = os.path.join(os.environ["FIXTURES"], "llama_untied")  # vocab 101
WORK = os.path.join(os.environ["WORK"], "packed-documents")
SEQ_LEN, BATCH = 72, 6
# float32 cos/sin tables (relative rounding 6e-8) reach the loss at about that size: measured
# 2.4e-8. A lost or misplaced mask moves the loss by 1e-2 and more.
TRANSFORMERS_BOUND = 1e-6
CHATS = [
    [{"role": "user", "content": "hi there"}, {"role": "assistant", "content": "hello, how are you?"}],
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "sum 2 and 3"},
     {"role": "assistant", "content": "5"}, {"role": "user", "content": "and 4 and 4?"},
     {"role": "assistant", "content": "8, as always"}],
    [{"role": "user", "content": "name a colour"}, {"role": "assistant", "content": "blue like the sky"}],
] + [[{"role": "user", "content": f"sum {a} and {a + 3}"}, {"role": "assistant", "content": str(2 * a + 3)}]
     for a in range(6)]  # short chats, two to a row


def prepare(*args):
    return subprocess.run([sys.executable, "scripts/prepare_data.py", *args], capture_output=True, text=True)


def check_prepared(tok, data, out):
    """Refusals with FILE:LINE, --skip-bad, and a mask that marks the assistant turns alone."""
    for line, reason in ((4, "not JSON"), (5, "messages must be"), (6, "without an assistant turn")):
        with open(data) as f:
            lines = f.readlines()
        bad = os.path.join(WORK, f"bad-{line}.jsonl")
        with open(bad, "w") as f:
            f.writelines(lines[:3] + [lines[line - 1]])  # the bad line becomes line 4
        refused = prepare(bad, "--tokenizer", os.path.join(WORK, "tok"), "--out", out)
        errors = refused.stderr.strip().splitlines()
        assert refused.returncode == 2 and len(errors) == 1 and f"{bad}:4: " in errors[0] and reason in errors[0], \
            (reason, refused.stderr)
    rows = os.path.join(WORK, "rows.parquet")
    pyarrow.parquet.write_table(pyarrow.table({"prompt": ["the weather? "], "completion": ["a fine day"]}), rows)
    done = prepare(data, rows, "--tokenizer", os.path.join(WORK, "tok"), "--out", out, "--skip-bad")
    assert done.returncode == 0 and "skipped 3 bad records" in done.stdout, done.stdout + done.stderr
    tokens, ends, mask, vocab = read_token_file(out)
    assert len(mask) == len(tokens) and vocab == len(tok) and len(ends) == len(CHATS) + 1 and ends[-1] == len(tokens)
    for chat, begin, end in zip(CHATS, [0] + ends, ends):
        learned = tok.decode([t for t, m in zip(tokens[begin:end], mask[begin:end]) if m])
        expected = "".join(m["content"] + "<|im_end|>\n" for m in chat if m["role"] == "assistant") + "<|endoftext|>"
        assert learned == expected, (learned, expected)
    completion = tok.decode([t for t, m in zip(tokens[ends[-2]:], mask[ends[-2]:]) if m])
    assert completion == "a fine day<|endoftext|>", completion
    return tokens, ends, mask


# Shows earlier assistant turns by their conclusion alone (what follows " so "), as templates
# that drop past reasoning do: a conversation is then no longer rendered prefix by prefix.
REWRITING_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' and not "
                      "loop.last %}{{ m['content'].split(' so ')[-1] }}{% else %}{{ m['content'] }}{% endif %}"
                      "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def check_rewriting_template():
    """Under a template that rewrites earlier turns, a chat becomes a document per assistant
    turn: the conversation up to it as transformers renders it, that turn alone learned."""
    tok = make_tokenizer(os.path.join(WORK, "tok-rewriting"), template=REWRITING_TEMPLATE)
    chat = [{"role": "user", "content": "add 2 and 3"}, {"role": "assistant", "content": "2 plus 3 is 5 so 5"},
            {"role": "user", "content": "and 4?"}, {"role": "assistant", "content": "5 plus 4 is 9 so 9"}]
    data, out = os.path.join(WORK, "rewriting.jsonl"), os.path.join(WORK, "rewriting.tok")
    with open(data, "w") as f:
        f.write(json.dumps({"messages": chat}) + "\n")
    done = prepare(data, "--tokenizer", os.path.join(WORK, "tok-rewriting"), "--out", out)
    assert done.returncode == 0, done.stderr
    tokens, ends, mask, _ = read_token_file(out)
    assert len(ends) == 2, ends
    for turn, (begin, end) in zip((1, 3), zip([0] + ends, ends)):
        expected = tok.apply_chat_template(chat[:turn + 1], return_dict=True)["input_ids"] + [tok.eos_token_id]
        assert tokens[begin:end] == expected, (tok.decode(tokens[begin:end]), tok.decode(expected))
        learned = tok.decode([t for t, m in zip(tokens[begin:end], mask[begin:end]) if m])
        assert learned == chat[turn]["content"] + "<|im_end|>\n<|endoftext|>", learned
    assert "2 plus 3" not in tok.decode(tokens[ends[0]:])  # the second turn sees the first rewritten


def run(name, *sets, nproc=1, expect_rc=0):
    run_dir = os.path.join(WORK, name)
    config = os.path.join(WORK, "run.toml")
    args = ["train", config, "--set", f'train.out_dir="{run_dir}"', *[a for s in sets for a in ("--set", s)]]
    cmd = [FSDPP, *args] if nproc == 1 else [FSDPP, "launch", "--nproc-per-node", str(nproc), "--", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == expect_rc, f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stderr[-3000:]}"
    return run_dir, proc


def train(name, *sets, nproc=1, key="loss"):
    """{step: loss} of a run, or of its held-out evaluations with key="eval_loss"."""
    run_dir, _ = run(name, *sets, nproc=nproc)
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        records = list(map(json.loads, f))
    if key == "loss":
        records = [r for r in records if "eval_loss" not in r]
    return {r["step"]: r[key] for r in records if key in r}


def gap(losses, reference):
    """The largest relative difference over the steps both have."""
    steps = sorted(set(losses) & set(reference))
    assert steps, (losses, reference)
    return max(abs(losses[s] - reference[s]) / abs(reference[s]) for s in steps)


def mean_loss(model, tokens, mask, chosen):
    """transformers' mean cross entropy over the learned targets of pieces, each run alone."""
    total, count = 0.0, 0
    with torch.no_grad():
        for begin, length, end, learned in chosen:
            targets = min(length, end - begin - 1)
            logits = model(torch.tensor([tokens[begin:begin + length]])).logits[0, :targets]
            labels = torch.tensor(tokens[begin + 1:begin + 1 + targets])
            labels = labels.masked_fill(~torch.tensor(mask[begin + 1:begin + 1 + targets]).bool(), -100)
            total += torch.nn.functional.cross_entropy(logits, labels, ignore_index=-100, reduction="sum").item()
            count += learned
    return total / count


def shuffled_and_held_out():
    """Shuffled rows, two to a step so that steps draw different rows: a resume mid-epoch at
    another world size continues the same order. Held-out documents evaluated at 2 ranks give
    one process's losses."""
    shuffled = ("data.shuffle=true", "data.batch_size=2")
    mixed = train("shuffled", *shuffled, "checkpoint.save_every=2")
    in_order = train("in-order", "data.batch_size=2")
    assert gap(mixed, in_order) > 1e-3, (mixed, in_order)  # the order did change
    saved = os.path.join(WORK, "shuffled", "checkpoints", "step-00000002")
    # Another split or choice of targets lays the rows out anew: the saved position would name
    # other rows.
    for name, change, field in [("on all tokens", 'data.train_on="all"', ""),
                                ("split anew", "data.eval_fraction=0.3", "documents = ")]:
        _, refused = run(f"resumed {name}", *shuffled, change, f'checkpoint.resume="{saved}"', expect_rc=2)
        assert f"cannot resume: its data position counts windows of a stream with {field}" in refused.stderr, \
            refused.stderr[-2000:]
    held_out = ("data.eval_fraction=0.3", "train.eval_every=2")
    evaluated = train("held-out", *held_out, key="eval_loss")
    assert sorted(evaluated) == [2, 4], evaluated
    return {"shuffled, resumed after step 2 at 2 ranks vs uninterrupted":
            (gap(train("shuffled-resumed", *shuffled, f'checkpoint.resume="{saved}"', nproc=2), mixed), FLOAT64_BOUND),
            "held-out losses at 2 ranks vs 1":
            (gap(train("held-out-two", *held_out, nproc=2, key="eval_loss"), evaluated), FLOAT64_BOUND)}


def main():
    shutil.rmtree(WORK, ignore_errors=True)
    os.makedirs(WORK)
    tok = make_tokenizer(os.path.join(WORK, "tok"))
    data = os.path.join(WORK, "chats.jsonl")
    with open(data, "w") as f:
        for chat in CHATS[:2]:
            f.write(json.dumps({"messages": chat}) + "\n")
        f.write("\n{not json\n" + json.dumps({"messages": "not a list"}) + "\n")
        f.write(json.dumps({"messages": [{"role": "user", "content": "anyone?"}]}) + "\n")
        for chat in CHATS[2:]:
            f.write(json.dumps({"messages": chat}) + "\n")
    out = os.path.join(WORK, "chats.tok")
    tokens, ends, mask = check_prepared(tok, data, out)
    check_rewriting_template()
    with open(os.path.join(WORK, "run.toml"), "w") as f:
        f.write(f'[model]\npath = "{FIXTURE}"\ndtype = "float64"\n'
                f'[data]\ntrain = "{out}"\nseq_len = {SEQ_LEN}\nbatch_size = {BATCH}\nshuffle = false\n'
                'train_on = "completion"\n[optimizer]\nlr = 1e-2\n[scheduler]\nkind = "constant"\n'
                '[train]\nsteps = 4\n[checkpoint]\nsave_final = false\n')
    one = train("one", "checkpoint.save_every=2")
    model = AutoModelForCausalLM.from_pretrained(FIXTURE, dtype=torch.float64)
    learned = pieces(ends, mask, SEQ_LEN, completion=True)
    rows = best_fit(learned, SEQ_LEN)
    first_step = mean_loss(model, tokens, mask, [p for row in rows[:BATCH] for p in row])
    # The step's `targets` figure counts the marked targets its loss was over, no padding.
    with open(os.path.join(WORK, "one", "metrics.jsonl")) as f:
        first_targets = next(r for r in map(json.loads, f) if "targets" in r)["targets"]
    want_targets = sum(p[3] for row in rows[:BATCH] for p in row)
    evaluated = json.loads(subprocess.run([FSDPP, "eval", os.path.join(WORK, "run.toml"), "--json"], check=True,
                                          capture_output=True, text=True).stdout)
    saved = os.path.join(WORK, "one", "checkpoints", "step-00000002")
    gaps = {"first loss vs transformers": (gap({1: one[1]}, {1: first_step}), TRANSFORMERS_BOUND),
            "eval loss vs transformers": (gap({0: evaluated["loss"]}, {0: mean_loss(model, tokens, mask, learned)}),
                                          TRANSFORMERS_BOUND),
            "2 ranks vs 1": (gap(train("two", nproc=2), one), FLOAT64_BOUND),
            "3 ranks vs 1": (gap(train("three", nproc=3), one), FLOAT64_BOUND),
            "2 micro-batches vs 1 batch": (gap(train("accum", "data.batch_size=3", "train.grad_accum=2"), one),
                                           FLOAT64_BOUND),
            "resumed after step 2 at 2 ranks vs uninterrupted":
                (gap(train("resumed", f'checkpoint.resume="{saved}"', nproc=2), one), FLOAT64_BOUND)}
    gaps.update(shuffled_and_held_out())
    everything = train("all", 'data.train_on="all"')
    _, refused = run("unpacked", "data.packing=false", expect_rc=2)
    errors = [l for l in refused.stderr.splitlines() if l.startswith("fsdpp: error:")]
    unpacked_ok = len(errors) == 1 and f"{out}: document 1 holds" in errors[0]
    failed = [k for k, (value, bound) in gaps.items() if not value <= bound]
    for k, (value, bound) in gaps.items():
        print(f"{'FAIL' if k in failed else 'ok  '} {k}: {value:.2e} (bound {bound:.0e})")
    print(f"{'ok  ' if unpacked_ok else 'FAIL'} packing = false refuses the long chat: {errors}")
    print(f"{'ok  ' if first_targets == want_targets else 'FAIL'} the first step's targets figure: {first_targets} "
          f"(the marked targets of its rows: {want_targets})")
    # Learning every token is a different objective: its loss must differ from the masked one.
    print(f"{len(learned)} pieces in {len(rows)} rows; first losses, completion {one[1]:.6f} vs all "
          f"{everything[1]:.6f}; transformers {first_step:.6f}")
    if failed or not unpacked_ok or abs(everything[1] - one[1]) < 1e-3 or first_targets != want_targets:
        sys.exit(1)


if __name__ == "__main__":
    main()
