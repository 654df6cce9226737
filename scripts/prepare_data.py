#!/usr/bin/env python3
"""Turns documents and conversations into an fsdpp token file of version 2: the tokens, each
document's end, and a loss mask marking which tokens are training targets
(engine/data/token_header.h gives the layout). The engine reads it; with
[data] train_on = "completion" it learns only the marked tokens.

Inputs, by extension:
  .txt             one document per file: its text as it is (a leading byte-order mark dropped)
  .jsonl, .parquet one record per line or row:
                   {"messages": [{"role": ..., "content": ...}, ...]}  a chat in OpenAI's
                       layout (content a string, a list of parts, or null beside
                       tool_calls; a "tools" list beside "messages" goes to the template, as
                       apply_chat_template(messages, tools=...) takes it); only the
                       assistant turns (with their end-of-turn tokens) are targets: the
                       tokens of what each adds to the rendering past the generation prompt,
                       as transformers' assistant mask marks a {% generation %} block; under a
                       template that rewrites earlier turns (dropping past reasoning), a
                       document per assistant turn, rendered as the template shows it
                   {"prompt": ..., "completion": ...}   only the completion is a target
                   {"<text field>": ...}                a document, every token a target
Every document ends with the tokenizer's end-of-text token, a target where the token before it
is one (not after a chat's closing user turn).

Tokenizer: --tokenizer DIR, a Hugging Face model directory (tokenizer.json, and the chat
template of tokenizer_config.json, applied through transformers); without it every byte is a
token and 256 ends a document (vocab 257, no chat template).

A bad record is reported as FILE:LINE (or FILE:ROW) and the reason, and ends the run with
exit status 2; with --skip-bad it is counted and skipped. On a terminal, a progress bar per
input file (bytes read, or rows) goes to stderr; stdout holds only the closing summary."""
import argparse
import os
import struct
import sys
import tempfile
from array import array

from tqdm import tqdm

from input_records import (KINDS, TOKEN_MAGIC as MAGIC, BadRecord, PlainText, Refused, check_out, fail, first_line,
                           open_input)

HEADER = struct.Struct("<8sIIQQQII")
FLAG_MASK = 1
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "ipython", "function")
BYTE_EOS = 256


class NoChatTemplate(BadRecord):
    """A chat the tokenizer cannot render: true of every chat, so never a record to skip."""


class ByteTokenizer:
    vocab_size = BYTE_EOS + 1
    eos_id = BYTE_EOS

    def encode(self, text):
        return list(text.encode("utf-8"))

    def chat(self, messages, tools=None):
        raise NoChatTemplate("a chat needs --tokenizer with a chat template (byte-level tokens have none)")

    def ends_with_eos(self, ids):
        return bool(ids) and ids[-1] == self.eos_id


class HfTokenizer:
    def __init__(self, path):
        # A directory on this machine: a name it lacks would otherwise be tried on the hub.
        if not os.path.isdir(path):
            fail(f"--tokenizer {path}: no such directory (a Hugging Face model directory holding its tokenizer)")
        try:
            from transformers import AutoTokenizer
            self.tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except Exception as e:  # any failure to load is the user's directory
            fail(f"cannot load the tokenizer of {path}: {first_line(e)}")
        if self.tok.eos_token_id is None:
            fail(f"{path}: the tokenizer has no end-of-text token (eos_token)")
        self.eos_id = self.tok.eos_token_id
        self.vocab_size = len(self.tok)

    def ends_with_eos(self, ids):
        """Whether the document's last token but blank ones is the end-of-text token: a chat
        template whose turns end with it (eos "<|im_end|>", as instruct models set it) wrote it
        already, followed by a newline."""
        k = len(ids)
        while k > 0 and ids[k - 1] != self.eos_id and not self.tok.decode([ids[k - 1]]).strip():
            k -= 1
        return k > 0 and ids[k - 1] == self.eos_id

    def encode(self, text):
        # verbose=False: a document longer than the model's context is no concern here.
        return self.tok.encode(text, add_special_tokens=False, verbose=False)

    def render(self, messages, tools, generation_prompt=False):
        """The template's text of messages (and the tools they may call), as apply_chat_template
        renders it."""
        try:
            if not messages:  # the generation prompt alone; transformers reads a list of lists as a batch
                return self.tok.apply_chat_template([[]], tools=tools, tokenize=False,
                                                    add_generation_prompt=generation_prompt)[0]
            return self.tok.apply_chat_template(messages, tools=tools, tokenize=False,
                                                add_generation_prompt=generation_prompt)
        except Exception as e:  # the template's own refusals (roles out of turn, an unknown role)
            what = "the generation prompt that opens the chat" if not messages else "it"
            raise BadRecord(f"the chat template refuses {what}: {first_line(e)}")

    def tokenize(self, text, spans):
        """(tokens, mask) of a rendered conversation: its tokens as apply_chat_template makes
        them, each marked where it holds a character of the learned spans, as transformers'
        assistant mask marks the tokens of a {% generation %} block (a token that merges the
        generation prompt's end with a turn's start is learned)."""
        encoded = self.tok(text, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
        mask, span = [], 0
        for begin, end in encoded["offset_mapping"]:
            while span < len(spans) and spans[span][1] <= begin:
                span += 1
            mask.append(int(span < len(spans) and spans[span][0] < max(end, begin + 1)))
        return list(encoded["input_ids"]), mask

    def chat(self, messages, tools=None):
        """The conversation as documents of (tokens, mask), each assistant turn's tokens past
        the generation prompt its targets. Rendered prefix by prefix it is one document, where
        the template renders every prefix of the conversation as a prefix of the whole; a
        template that rewrites earlier turns (one dropping past reasoning, say) gives a
        document per assistant turn instead, the conversation up to that turn as the template
        renders it, with that turn alone learned: what the model is shown when it answers."""
        if self.tok.chat_template is None:
            raise NoChatTemplate("the tokenizer has no chat template")
        if not self.tok.is_fast:
            raise NoChatTemplate("a chat needs a fast tokenizer (tokenizer.json) to find each turn's tokens")
        whole = self.prefix_rendering(messages, tools)
        if whole is not None:
            return [self.tokenize(*whole)]
        turns = []
        for k, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            context = self.render(messages[:k], tools, generation_prompt=True)
            full = self.render(messages[:k + 1], tools)
            if not full.startswith(context):
                raise BadRecord(f"the chat template renders assistant message {k} without the generation prompt "
                                "it renders before it")
            turns.append(self.tokenize(full, [(len(context), len(full))]))
        return turns

    def prefix_rendering(self, messages, tools):
        """(text, learned character spans) of the conversation rendered message by message, or
        None where the template renders a message by changing what came before it. An
        assistant message's span is what it adds past the generation prompt: under ChatML,
        everything after "<|im_start|>assistant\n", its content, "<|im_end|>" and the newline."""
        text, spans = "", []
        for k, message in enumerate(messages):
            assistant = message["role"] == "assistant"
            context = self.render(messages[:k], tools, generation_prompt=assistant) if k or assistant else ""
            full = self.render(messages[:k + 1], tools)
            if not full.startswith(text) or not full.startswith(context):
                return None
            if assistant:
                spans.append((max(len(text), len(context)), len(full)))
            text = full
        return text, spans


def documents(tokenizer, record, text_field):
    """The documents of one record as (tokens, mask), without end-of-text tokens: one, or for a
    chat under a template that rewrites earlier turns, one per assistant turn."""
    if isinstance(record, BadRecord):  # a line that is not JSON
        raise record
    if isinstance(record, PlainText):
        if not record:
            raise BadRecord("an empty document")
        ids = tokenizer.encode(record)
        return [(ids, [1] * len(ids))]
    if not isinstance(record, dict):
        raise BadRecord("not a JSON object")
    # Parquet rows hold every column, null where a record has no such field.
    if record.get("messages") is not None:
        messages, tools = record["messages"], record.get("tools")
        check_chat(messages, tools)
        return tokenizer.chat(messages, tools)
    if record.get("prompt") is not None or record.get("completion") is not None:
        prompt, completion = record.get("prompt"), record.get("completion")
        if not isinstance(prompt, str) or not isinstance(completion, str) or not completion:
            raise BadRecord("prompt and completion must be strings, the completion not empty")
        p, c = tokenizer.encode(prompt), tokenizer.encode(completion)
        return [(p + c, [0] * len(p) + [1] * len(c))]
    text = record.get(text_field)
    if not isinstance(text, str) or not text:
        raise BadRecord(f"no '{text_field}' string, nor messages, nor prompt and completion")
    ids = tokenizer.encode(text)
    return [(ids, [1] * len(ids))]


def check_chat(messages, tools):
    """BadRecord, naming the message and field, unless `messages` is a chat in OpenAI's layout
    with an assistant turn, and `tools` (None: none) a list of objects."""
    if not isinstance(messages, list) or not messages:
        raise BadRecord("messages must be a non-empty list of {role, content} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadRecord(f"messages[{i}]: expected an object with a role string")
        # A template renders a role it does not know as it renders any: a typo would train as context.
        if m["role"] not in CHAT_ROLES:
            raise BadRecord(f"messages[{i}]: role '{m['role']}' is not one of {', '.join(CHAT_ROLES)}")
        content = m.get("content")
        if isinstance(content, list):
            if not all(isinstance(part, dict) for part in content):
                raise BadRecord(f"messages[{i}]: content as a list must hold parts, objects such as "
                                "{\"type\": \"text\", \"text\": ...}")
        elif not isinstance(content, str) and not (content is None and m.get("tool_calls")):
            raise BadRecord(f"messages[{i}]: content must be a string, a list of parts, or null beside tool_calls")
    if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
        raise BadRecord("tools must be a list of objects (function schemas), as apply_chat_template takes them")
    if not any(m["role"] == "assistant" for m in messages):
        raise BadRecord("a chat without an assistant turn has nothing to learn")


def write(out, tokens, ends, mask, vocab):
    width = 2 if vocab <= 65536 else 4
    packed = tokens if tokens.itemsize == width else array("H" if width == 2 else "I", tokens)
    ends = array("Q", ends)
    if sys.byteorder != "little":
        packed.byteswap()
        ends.byteswap()
    tmp = None
    try:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        # A name no file had, beside the output: a file of the user's is never written over.
        fd, tmp = tempfile.mkstemp(prefix=os.path.basename(out) + ".tmp-", dir=os.path.dirname(os.path.abspath(out)))
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # as open() would have made it, where mkstemp makes 0600
        with os.fdopen(fd, "wb") as f:
            f.write(HEADER.pack(MAGIC, 2, width, len(tokens), vocab, len(ends), FLAG_MASK, 0))
            f.write(packed.tobytes())
            f.write(ends.tobytes())
            f.write(mask)
        os.replace(tmp, out)
        tmp = None
    except OSError as e:
        fail(f"cannot write {out}: {e.strerror}")
    finally:  # whatever stopped the write (Ctrl-C too)
        if tmp is not None and os.path.exists(tmp):
            os.remove(tmp)


def prepare(args):
    for path in args.inputs:  # refused before any work: a file no reader takes, or none at all
        if os.path.splitext(path)[1].lower() not in KINDS:
            fail(f"{path}: unknown input kind (.txt, .jsonl or .parquet)")
        try:
            os.stat(path)
        except OSError as e:
            fail(f"cannot read {path}: {e.strerror}")
    check_out(args.out, args.inputs)
    tokenizer = HfTokenizer(args.tokenizer) if args.tokenizer else ByteTokenizer()
    # Held as the file holds them: 2 bytes a token where the vocabulary allows.
    tokens, ends, mask, skipped = array("H" if tokenizer.vocab_size <= 65536 else "I"), [], bytearray(), 0
    for path in args.inputs:
        size, unit, rows = open_input(path)
        # On a terminal only (disable=None), on stderr; stdout keeps the one summary line.
        with tqdm(total=size, unit=unit, unit_scale=unit == "B", unit_divisor=1024 if unit == "B" else 1000,
                  desc=os.path.basename(path), file=sys.stderr, disable=None, leave=False, dynamic_ncols=True) as bar:
            for number, record, read in rows:
                try:
                    parts = documents(tokenizer, record, args.text_field) if record is not None else []
                except NoChatTemplate as e:  # the tokenizer's, which no record could pass
                    fail(f"{path}:{number}: {e}")
                except BadRecord as e:
                    if not args.skip_bad:
                        fail(f"{path}:{number}: {e} (--skip-bad skips such records)")
                    skipped += 1
                    parts = []
                for ids, marks in parts:
                    # One end-of-text token, learned where the document ends on something learned
                    # (not after a chat's closing user turn); a template may have written it already.
                    if not tokenizer.ends_with_eos(ids):
                        ids, marks = ids + [tokenizer.eos_id], marks + [marks[-1] if marks else 1]
                    try:
                        tokens.fromlist(ids)  # all or nothing
                    except OverflowError:  # an id past the vocabulary: 4 bytes a token after all
                        tokens = array("I", tokens)
                        tokens.fromlist(ids)
                    mask.extend(marks)
                    ends.append(len(tokens))
                if bar.update(read):
                    bar.set_postfix_str(f"{len(ends)} documents, {len(tokens)} tokens", refresh=False)
    if not ends:
        fail("no documents in the inputs")
    # Every token below the vocabulary the file names, even from a tokenizer whose ids skip some.
    vocab = max(tokenizer.vocab_size, max(tokens) + 1)
    write(args.out, tokens, ends, mask, vocab)
    print(f"wrote {args.out}: {len(ends)} documents, {len(tokens)} tokens ({sum(mask)} targets), "
          f"vocab {vocab}" + (f"; skipped {skipped} bad records" if skipped else ""))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.error = fail
    ap.add_argument("inputs", nargs="+", metavar="INPUT", help=".txt, .jsonl or .parquet files")
    ap.add_argument("--out", required=True, metavar="FILE", help="token file to write")
    ap.add_argument("--tokenizer", metavar="DIR", help="Hugging Face model directory whose tokenizer to use")
    ap.add_argument("--text-field", default="text", help="the field of a plain document record (default: text)")
    ap.add_argument("--skip-bad", action="store_true", help="skip and count bad records instead of stopping")
    try:
        prepare(ap.parse_args())
    except Refused as e:
        print(f"prepare_data: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
