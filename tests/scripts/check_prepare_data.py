"""scripts/prepare_data.py on every kind of input it takes, read back from the token file it
writes. A chat's loss mask equals transformers' own assistant mask (apply_chat_template with
return_assistant_tokens_mask under a ChatML template whose {% generation %} blocks cover what
prepare_data learns: everything an assistant message adds past "<|im_start|>assistant\\n") on a
byte-level BPE trained here, token for token, for multi-turn chats, a system prompt, unicode,
an assistant that opens the chat, an empty answer, a chat closing on a user turn, and answers
whose first token merges with the generation prompt's newline; a mask one token off anywhere
fails. With "<|im_end|>" as the end-of-text token the template's own closes each chat, with no
second one appended. Parquet chats (a list<struct<role, content>> column) are held to the same,
and so are tool-calling chats in OpenAI's layout (null content beside tool_calls, a tool's
answer, content as a list of parts, the record's "tools" given to the template).

Without --tokenizer a .txt file is one document of its UTF-8 bytes (a byte-order mark
dropped, CR LF kept), every token a target, 256 ending it, vocab 257, 2-byte tokens; JSONL
plain records are read from --text-field; a tokenizer of more than 65536 tokens gives 4-byte
tokens that read back as they were encoded. A chat without a tokenizer, a bad Parquet row, a
Parquet file that is not one, an assistant turn of null content without tool calls, an unknown extension, a missing file, invalid UTF-8 and inputs
whose every record is bad (under --skip-bad) are refused with exit status 2 and one stderr
line naming the file (and the line, row or byte); --skip-bad skips and counts bad records, but
not a chat the tokenizer cannot render (every chat would be).
On a terminal a progress bar goes to stderr while stdout keeps its one summary line."""
import fcntl
import json
import os
import random
import shutil
import struct
import subprocess
import sys
import termios

import pyarrow
import pyarrow.parquet

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
from packed_rows import read_token_file  # noqa: E402

PREPARE = os.path.join(ROOT, "scripts", "prepare_data.py")
WORK = os.path.join(os.environ["WORK"], "prepare-data")
HEADER = struct.Struct("<8sIIQQQII")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# ChatML; each assistant message's part past the generation prompt is its generation block.
CHATML = ("{% for m in messages %}{% if m['role'] == 'assistant' %}<|im_start|>assistant\n{% generation %}"
          "{{ m['content'] }}<|im_end|>\n{% endgeneration %}{% else %}<|im_start|>{{ m['role'] }}\n"
          "{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
WORDS = ("the a of to and in is it you that was for on are with as they be at one have this from or had by word "
         "but what some we can out other were all there when up use your how said an each which do their time if "
         "will way about many then them write would like so these long make thing see two has look more day could "
         "go come number sound no most people over know water than call first who may down side been now find any "
         "new work part take get place made live where after back little only round year came show every good give "
         "under name very through just form sentence great think say help line turn cause much mean before move "
         "right old too same tell does set three want well also play small end put home read hand large add even "
         "land here must big high such follow act why ask change went light kind off need house try again point "
         "world near build earth").split()
U, A, S = "user", "assistant", "system"
CHATS = [
    [(U, "What is the word?"), (A, "The word is water.")],
    [(S, "Be brief, and answer in one line."), (U, "Add two and three."), (A, "Five."),
     (U, "And then four more?"), (A, " Nine, as always."), (U, "Thanks!"), (A, "You are welcome.\n")],
    [(U, "Héllo, wörld — naïve café?"), (A, "日本語 の テキスト ✓ and 🙂 too"), (U, "ok")],  # closes on a user turn
    [(A, "Hello! How can I help?"), (U, "Say hi."), (A, "hi")],  # the assistant opens the chat
    [(S, "You greet first."), (A, "Good day to you."), (U, "   "), (A, "")],
    # Answers opening on newlines: their first token merges with the generation prompt's "\n".
    [(U, "Write a line."), (A, "\n\nThe end of the line\n\n"), (U, "Again,\n\nplease."), (A, "\n\n\nOnce more.  ")],
]
CHATS = [[{"role": r, "content": c} for r, c in chat] for chat in CHATS]


def prepare(*args):
    return subprocess.run([sys.executable, PREPARE, *args], capture_output=True, text=True)


def path(name):
    return os.path.join(WORK, name)


def write_bytes(name, data):
    with open(path(name), "wb") as f:
        f.write(data)
    return path(name)


def write_jsonl(name, records):
    return write_bytes(name, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode())


def done(result):
    assert result.returncode == 0 and not result.stderr, (result.returncode, result.stderr)
    return result.stdout


def refused(result, *needles):
    """Exit status 2 and one stderr line holding every needle (the file, the line or row)."""
    lines = result.stderr.splitlines()
    assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith("prepare_data: ") and all(
        n in lines[0] for n in needles), (result.returncode, result.stderr, needles)
    assert not result.stdout, result.stdout
    return lines[0]


def read(out):
    """The token file as (tokens, ends, mask, vocab, width), its layout checked against the
    header: every section where token_header.h puts it, nothing after."""
    with open(out, "rb") as f:
        data = f.read()
    magic, version, width, count, vocab, documents, flags, zero = HEADER.unpack_from(data)
    assert (magic, version, flags, zero) == (b"FSDPTOK\x00", 2, 1, 0), (magic, version, flags, zero)
    assert width in (2, 4) and len(data) == HEADER.size + width * count + 8 * documents + count, (width, len(data))
    tokens, ends, mask, vocab_read = read_token_file(out)
    assert vocab_read == vocab and len(tokens) == len(mask) == count and len(ends) == documents
    assert ends == sorted(set(ends)) and ends[-1] == count and set(mask) <= {0, 1}
    assert max(tokens) < vocab, (max(tokens), vocab)
    return tokens, ends, mask, vocab, width


def split(tokens, ends, mask):
    """Each document's (tokens, mask)."""
    return [(tokens[b:e], mask[b:e]) for b, e in zip([0] + ends, ends)]


def check_bytes():
    """.txt and JSONL plain text without a tokenizer: the UTF-8 bytes, every one a target."""
    first = "Héllo, wörld — ✓ 🙂\r\nsecond line\n"
    second = "a byte-order mark is no text"
    txt = [write_bytes("one.txt", first.encode()), write_bytes("bom.txt", b"\xef\xbb\xbf" + second.encode())]
    out = path("text.tok")
    assert "2 documents" in done(prepare(*txt, "--out", out))
    tokens, ends, mask, vocab, width = read(out)
    assert (vocab, width) == (257, 2), (vocab, width)
    expected = [list(t.encode("utf-8")) + [256] for t in (first, second)]
    assert split(tokens, ends, mask) == [(e, [1] * len(e)) for e in expected], (tokens, ends, mask)

    # Records read from --text-field; line numbers count blank lines; CR LF ends a line.
    bodies = ["naïve body", "second body", "x"]
    records = write_bytes("body.jsonl", (json.dumps({"body": bodies[0], "text": "not this"}) + "\n\n" +
                                         json.dumps({"body": bodies[1]}) + "\r\n" +
                                         json.dumps({"body": bodies[2], "id": 3}) + "\n").encode())
    out = path("body.tok")
    done(prepare(records, "--text-field", "body", "--out", out))
    tokens, ends, mask, vocab, width = read(out)
    expected = [list(b.encode("utf-8")) + [256] for b in bodies]
    assert (vocab, width) == (257, 2) and split(tokens, ends, mask) == [(e, [1] * len(e)) for e in expected]
    refused(prepare(records, "--out", out, "--text-field", "title"), f"{records}:1: no 'title' string")
    missing = write_bytes("no-body.jsonl", b'{"body": "fine"}\n\n{"text": "no body"}\n')
    refused(prepare(missing, "--text-field", "body", "--out", out), f"{missing}:3: no 'body' string")

    # A chat needs a tokenizer with a chat template: true of every chat, so --skip-bad does not
    # skip it, where it would drop every chat and keep the rest.
    chats = write_jsonl("byte-chat.jsonl", [{"text": "plain"}, {"messages": CHATS[0]}])
    refused(prepare(chats, "--out", out), f"{chats}:2: a chat needs --tokenizer")
    said = refused(prepare(chats, "--out", out, "--skip-bad"), f"{chats}:2: a chat needs --tokenizer")
    assert "--skip-bad" not in said, said


def check_refusals():
    """Files no reader takes, and inputs with nothing to learn, refused on one line."""
    out = path("refused.tok")
    good = write_bytes("good.txt", b"fine")
    garbage = write_bytes("garbage.parquet", bytes(random.Random(0).randrange(256) for _ in range(3000)))
    refused(prepare(good, garbage, "--out", out), f"{garbage}: not a readable Parquet file")
    unknown = write_bytes("table.csv", b"a,b\n1,2\n")
    refused(prepare(good, unknown, "--out", out), f"{unknown}: unknown input kind")
    for name in ("missing.jsonl", "missing.parquet", "missing.txt"):
        refused(prepare(good, path(name), "--out", out), f"cannot read {path(name)}: No such file or directory")
    # Past the first buffer of text, the byte named is the file's own.
    padding = json.dumps({"text": "ok"}).encode() + b"\n"
    invalid = write_bytes("invalid.jsonl", padding * 2000 + b'{"text": "\xff"}\n')
    byte = 2000 * len(padding) + len(b'{"text": "')
    refused(prepare(invalid, "--out", out), f"{invalid}:2001: not valid UTF-8 (invalid start byte at byte {byte})")
    text_file = write_bytes("invalid.txt", b"fine\nbad \xff\n")
    refused(prepare(text_file, "--out", out), f"{text_file}:2: not valid UTF-8 (invalid start byte at byte 9)")
    # JSON's escapes can spell half a surrogate pair, which no UTF-8 text holds.
    half = write_bytes("half-pair.jsonl", b'{"text": "fine \\u00e9"}\n{"text": "bad \\ud800 x"}\n')
    refused(prepare(half, "--out", out), f"{half}:2: holds an escape of half a surrogate pair")
    refused(prepare(good, "--tokenizer", path("no-such-dir"), "--out", out),
            f"--tokenizer {path('no-such-dir')}: no such directory")
    bad = write_bytes("all-bad.jsonl", b'{not json\n[1, 2]\n{"text": ""}\n{"messages": []}\n')
    refused(prepare(bad, "--out", out), f"{bad}:1: not JSON")
    refused(prepare(bad, "--out", out, "--skip-bad"), "no documents in the inputs")
    assert not os.path.exists(out), "a refused run wrote its output"
    # The output replaces a token file alone, and never an input; a file of the user's named
    # like its temporary file is left as it was.
    notes = write_bytes("notes.txt", b"my notes\n")
    refused(prepare(notes, "--out", notes), f"--out {notes}: is one of the inputs")
    config = write_bytes("config.json", b"{}")
    refused(prepare(good, "--out", config), f"--out {config}: holds something other than a token file")
    assert open(notes, "rb").read() == b"my notes\n" and open(config, "rb").read() == b"{}"
    kept = write_bytes("kept.tok.tmp", b"mine")
    done(prepare(good, "--out", path("kept.tok")))
    umask = os.umask(0o027)  # inherited by the script, whose output takes it as open() would
    try:
        done(prepare(good, "--out", path("kept.tok")))  # over a token file: replaced
    finally:
        os.umask(umask)
    assert os.stat(path("kept.tok")).st_mode & 0o777 == 0o640, oct(os.stat(path("kept.tok")).st_mode)
    done(prepare(good, "--out", write_bytes("empty.tok", b"")))  # an empty file too (mktemp's)
    assert open(kept, "rb").read() == b"mine"
    assert not [n for n in os.listdir(WORK) if n.startswith("kept.tok.tmp-")], "a temporary file was left"


def check_progress():
    """On a terminal, a progress bar on stderr naming the file; stdout as without one."""
    data = write_jsonl("progress.jsonl", [{"text": f"document {i}"} for i in range(50)])
    out = path("progress.tok")
    master, terminal = os.openpty()
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))
    proc = subprocess.Popen([sys.executable, PREPARE, data, "--out", out], stdout=subprocess.PIPE, stderr=terminal)
    os.close(terminal)
    shown = b""
    while True:
        try:
            chunk = os.read(master, 4096)
        except OSError:  # the terminal's last writer is gone
            break
        if not chunk:
            break
        shown += chunk
    os.close(master)
    stdout = proc.stdout.read().decode()
    assert proc.wait() == 0, shown
    shown = shown.decode(errors="replace")
    assert "progress.jsonl" in shown and "%|" in shown, repr(shown)
    assert stdout == f"wrote {out}: 50 documents, {sum(len(f'document {i}') + 1 for i in range(50))} tokens " \
        f"({sum(len(f'document {i}') + 1 for i in range(50))} targets), vocab 257\n", stdout


def corpus(rng):
    """Text to train the BPE on: sentences, with the newlines, spaces and characters the chats hold."""
    lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12))).capitalize() +
             rng.choice(".?!,:") + rng.choice([" ", "\n", "\n\n", "\n\n\n", "  "]) for _ in range(3000)]
    return lines + [m["content"] for chat in CHATS for m in chat] * 20


def make_bpe(directory):
    """A byte-level BPE of a few hundred merges with the ChatML specials and template, saved as
    a model's tokenizer is."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    core.train_from_iterator(corpus(random.Random(0)), trainers.BpeTrainer(
        vocab_size=256 + len(SPECIALS) + 400, special_tokens=SPECIALS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token=SPECIALS[0], additional_special_tokens=SPECIALS[1:])
    tok.chat_template = CHATML
    tok.save_pretrained(directory)
    return tok


def expected_chat(tok, chat):
    """transformers' tokens and assistant mask of a chat, with the end-of-text token and its
    mark (learned after an assistant turn)."""
    r = tok.apply_chat_template(chat, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    return (list(r["input_ids"]) + [tok.eos_token_id],
            list(r["assistant_masks"]) + [int(chat[-1]["role"] == "assistant")])


def check_chats():
    """Chats from JSONL and Parquet: tokens and mask those of transformers, chat by chat."""
    tok = make_bpe(path("bpe"))
    # The test's own premises: the template's generation block covers an answer's content,
    # "<|im_end|>" and newline, and some answer's first token merges with the generation
    # prompt's end (so the prompt's tokens are no prefix of the chat's).
    ids, marks = expected_chat(tok, CHATS[0])
    assert tok.decode([t for t, m in zip(ids, marks) if m]) == "The word is water.<|im_end|>\n<|endoftext|>"
    merged = CHATS[-1]
    prompt = tok.apply_chat_template(merged[:1], add_generation_prompt=True, return_dict=True)["input_ids"]
    whole = tok.apply_chat_template(merged[:2], return_dict=True)["input_ids"]
    assert whole[:len(prompt)] != prompt, "no merge across the prompt"

    jsonl = write_jsonl("chats.jsonl", [{"messages": chat} for chat in CHATS[:4]])
    struct_type = pyarrow.list_(pyarrow.struct([("role", pyarrow.string()), ("content", pyarrow.string())]))
    rows = CHATS[4:5] + [[{"role": "user", "content": "no answer"}]] + CHATS[5:]  # row 2 is bad
    parquet = path("chats.parquet")
    pyarrow.parquet.write_table(pyarrow.table({"messages": pyarrow.array(rows, type=struct_type)}), parquet)
    assert pyarrow.parquet.read_schema(parquet).field("messages").type == struct_type
    out = path("chats.tok")
    refused(prepare(jsonl, parquet, "--tokenizer", path("bpe"), "--out", out),
            f"{parquet}:2: a chat without an assistant turn")
    # A role the template renders like any other would train a typo as context.
    robot = write_jsonl("robot.jsonl", [{"messages": [{"role": "robot", "content": "hi"}, *CHATS[0][1:]]}])
    refused(prepare(robot, "--tokenizer", path("bpe"), "--out", out),
            f"{robot}:1: messages[0]: role 'robot' is not one of system, developer, user, assistant, tool")
    # An assistant turn of no content and no tool call is no turn of OpenAI's layout.
    empty = write_jsonl("empty-turn.jsonl", [{"messages": [CHATS[0][0], {"role": "assistant", "content": None}]}])
    refused(prepare(empty, "--tokenizer", path("bpe"), "--out", out),
            f"{empty}:1: messages[1]: content must be a string, a list of parts, or null beside tool_calls")
    result = prepare(jsonl, parquet, "--tokenizer", path("bpe"), "--out", out, "--skip-bad")
    assert done(result).rstrip().endswith("skipped 1 bad records"), f"a good chat was refused: {result.stdout}"
    tokens, ends, mask, vocab, width = read(out)
    assert (vocab, width) == (len(tok), 2), (vocab, width)
    assert len(ends) == len(CHATS), ends
    for k, (chat, (ids, marks)) in enumerate(zip(CHATS, split(tokens, ends, mask))):
        want_ids, want_marks = expected_chat(tok, chat)
        assert ids == want_ids, (k, [tok.decode([t]) for t in ids], [tok.decode([t]) for t in want_ids])
        differ = [i for i, (a, b) in enumerate(zip(marks, want_marks)) if a != b]
        assert not differ, f"chat {k}: mask differs from transformers' at tokens {differ}: " \
            f"{[(tok.decode([ids[i]]), marks[i], want_marks[i]) for i in differ]}"
    check_turn_end_eos(tok, jsonl)
    check_tool_chats(tok)
    return len(tokens)


def check_turn_end_eos(tok, jsonl):
    """A tokenizer whose end-of-text token ends every turn ("<|im_end|>", as instruct models
    set it): the template wrote it, so each chat is transformers' tokens and mask as they are,
    no second "<|im_end|>" learned after the last turn's newline."""
    tok.eos_token = "<|im_end|>"
    tok.save_pretrained(path("bpe-im-end"))
    out = path("im-end.tok")
    done(prepare(jsonl, "--tokenizer", path("bpe-im-end"), "--out", out))
    tokens, ends, mask, _, _ = read(out)
    for k, (chat, (ids, marks)) in enumerate(zip(CHATS[:4], split(tokens, ends, mask))):
        r = tok.apply_chat_template(chat, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        assert (ids, marks) == (list(r["input_ids"]), list(r["assistant_masks"])), \
            (k, [tok.decode([t]) for t in ids[-4:]], marks[-4:])


# ChatML with tools in a system block, tool calls in the assistant's generation block and
# content given as a list of text parts, as OpenAI's layout and tool-calling templates have them.
TOOLS_CHATML = (
    "{% if tools %}<|im_start|>system\nTools: {% for t in tools %}{{ t['function']['name'] }} {% endfor %}"
    "<|im_end|>\n{% endif %}{% for m in messages %}{% if m['role'] == 'assistant' %}<|im_start|>assistant\n"
    "{% generation %}{% if m['content'] %}{{ m['content'] }}{% endif %}{% for c in m['tool_calls'] or [] %}"
    "<call>{{ c['function']['name'] }}({{ c['function']['arguments'] }})</call>{% endfor %}<|im_end|>\n"
    "{% endgeneration %}{% else %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for part in m['content'] %}{{ part['text'] }}{% endfor %}{% endif %}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "the weather of a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}


def check_tool_chats(tok):
    """Tool-calling chats in OpenAI's layout (an assistant turn of null content and tool_calls,
    a tool's answer, content as parts, the record's tools): transformers' tokens and assistant
    mask given the same tools, the tools' names rendered into the context."""
    tok.chat_template, tok.eos_token = TOOLS_CHATML, SPECIALS[0]  # as make_bpe made it, but the template
    tok.save_pretrained(path("bpe-tools"))
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    records = [
        {"tools": [WEATHER], "messages": [
            {"role": "user", "content": "What is the weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "21C and sun"},
            {"role": "assistant", "content": "It is 21C and sunny."}]},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "Say "}, {"type": "text", "text": "hi."}]},
                      {"role": "assistant", "content": "hi"}]},
    ]
    out = path("tools.tok")
    done(prepare(write_jsonl("tools.jsonl", records), "--tokenizer", path("bpe-tools"), "--out", out))
    tokens, ends, mask, _, _ = read(out)
    for k, (record, (ids, marks)) in enumerate(zip(records, split(tokens, ends, mask))):
        r = tok.apply_chat_template(record["messages"], tools=record.get("tools"), tokenize=True, return_dict=True,
                                    return_assistant_tokens_mask=True)
        want = (list(r["input_ids"]) + [tok.eos_token_id], list(r["assistant_masks"]) + [1])
        assert (ids, marks) == want, (k, tok.decode(ids), tok.decode(want[0]))
    assert "Tools: get_weather" in tok.decode(split(tokens, ends, mask)[0][0]), "the record's tools were not rendered"


def check_wide_vocab():
    """More than 65536 tokens: 4-byte tokens, the ones past 65535 read back as encoded."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<eos>": 1, **{f"w{i}": i + 2 for i in range(69998)}}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<eos>", unk_token="<unk>")
    tok.save_pretrained(path("wide"))
    text = "w0 w65533 w65534 w65535 w69997 w12345"
    data = write_bytes("wide.txt", text.encode())
    out = path("wide.tok")
    done(prepare(data, "--tokenizer", path("wide"), "--out", out))
    tokens, ends, mask, vocab_size, width = read(out)
    assert (vocab_size, width) == (70000, 4), (vocab_size, width)
    assert tokens == [2, 65535, 65536, 65537, 69999, 12347, 1] == tok.encode(text) + [1], tokens
    assert ends == [7] and mask == [1] * 7 and tok.decode(tokens[:-1]) == text


def check_gapped_ids():
    """make_tokens.py with a vocabulary whose ids skip values: the file's vocabulary holds its
    largest id, as the engine requires."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    core = Tokenizer(models.WordLevel(vocab={"a": 0, "[UNK]": 1, "b": 5}, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.save(path("gapped.json"))
    out = path("gapped.tok")
    made = subprocess.run([sys.executable, "scripts/make_tokens.py", "--tokenizer", path("gapped.json"), "--out", out,
                           write_bytes("gapped.txt", b"a b a b")], capture_output=True, text=True)
    assert made.returncode == 0, made.stderr
    with open(out, "rb") as f:
        data = f.read()
    version, width, count, vocab_size = struct.unpack_from("<IIQQ", data, 8)  # a plain stream: version 1
    tokens = list(struct.unpack_from(f"<{count}H", data, 32)) if width == 2 else None
    assert (version, width, tokens, vocab_size) == (1, 2, [0, 5, 0, 5], 6), (version, width, tokens, vocab_size)


def main():
    shutil.rmtree(WORK, ignore_errors=True)
    os.makedirs(WORK)
    check_bytes()
    check_refusals()
    check_progress()
    chat_tokens = check_chats()
    check_wide_vocab()
    check_gapped_ids()
    print(f"ok: byte-level .txt and JSONL, {len(CHATS)} chats ({chat_tokens} tokens) match transformers' tokens and "
          "assistant mask, Parquet chats, 4-byte tokens, refusals and the progress bar")


if __name__ == "__main__":
    main()
