#!/usr/bin/env python3
"""Turns documents and conversations into an fsdpp token file of version 2: the tokens, each
document's end, and a loss mask marking which tokens are training targets
(engine/train/token_header.h gives the layout). The engine reads it; with
[data] train_on = "completion" it learns only the marked tokens.

Inputs, by extension:
  .txt             one document per file
  .jsonl, .parquet one record per line or row:
                   {"messages": [{"role": ..., "content": ...}, ...]}  a chat; only the
                       assistant turns (with their end-of-turn tokens) are targets; under a
                       template that rewrites earlier turns (dropping past reasoning), a
                       document per assistant turn, rendered as the template shows it
                   {"prompt": ..., "completion": ...}   only the completion is a target
                   {"<text field>": ...}                a document, every token a target
Every document ends with the tokenizer's end-of-text token, a target where the token before it
is one (not after a chat's closing user turn).

Tokenizer: --tokenizer DIR, a Hugging Face model directory (tokenizer.json, and the chat
template of tokenizer_config.json, applied through transformers); without it every byte is a
token and 256 ends a document (vocab 257, no chat template).

A bad record is reported as FILE:LINE and the reason, and ends the run with exit status 2;
with --skip-bad it is counted and skipped."""
import argparse
import json
import os
import struct
import sys

MAGIC = b"FSDPTOK\x00"
HEADER = struct.Struct("<8sIIQQQII")
FLAG_MASK = 1
BYTE_EOS = 256


class BadRecord(Exception):
    pass


def fail(message):
    print(f"prepare_data: {message}", file=sys.stderr)
    sys.exit(2)


class ByteTokenizer:
    vocab_size = BYTE_EOS + 1
    eos_id = BYTE_EOS

    def encode(self, text):
        return list(text.encode("utf-8"))

    def chat(self, messages):
        raise BadRecord("a chat needs --tokenizer with a chat template (byte-level tokens have none)")


class HfTokenizer:
    def __init__(self, path):
        try:
            from transformers import AutoTokenizer
            self.tok = AutoTokenizer.from_pretrained(path)
        except Exception as e:  # any failure to load is the user's directory
            fail(f"cannot load the tokenizer of {path}: {str(e).splitlines()[0]}")
        if self.tok.eos_token_id is None:
            fail(f"{path}: the tokenizer has no end-of-text token (eos_token)")
        self.eos_id = self.tok.eos_token_id
        self.vocab_size = len(self.tok)

    def encode(self, text):
        return self.tok.encode(text, add_special_tokens=False)

    def render(self, messages, generation_prompt=False):
        try:
            return list(self.tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=generation_prompt))
        except Exception as e:  # the template's own refusals (roles out of turn, an unknown role)
            raise BadRecord(f"the chat template refuses it: {str(e).splitlines()[0]}")

    def chat(self, messages):
        """The conversation as documents of (tokens, mask), each assistant turn's tokens past
        the generation prompt its targets. Rendered prefix by prefix it is one document, where
        the template renders every prefix of the conversation as a prefix of the whole; a
        template that rewrites earlier turns (one dropping past reasoning, say) gives a
        document per assistant turn instead, the conversation up to that turn as the template
        renders it, with that turn alone learned: what the model is shown when it answers."""
        if self.tok.chat_template is None:
            raise BadRecord("the tokenizer has no chat template")
        whole = self.prefix_rendering(messages)
        if whole is not None:
            return [whole]
        turns = []
        for k, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            context = self.render(messages[:k], generation_prompt=True) if k else []
            full = self.render(messages[:k + 1])
            if full[:len(context)] != context:
                raise BadRecord(f"the chat template renders assistant message {k} without the generation prompt "
                                "it renders before it")
            turns.append((full, [0] * len(context) + [1] * (len(full) - len(context))))
        return turns

    def prefix_rendering(self, messages):
        """(tokens, mask) of the conversation rendered message by message, or None where the
        template renders a message by changing what came before it."""
        ids, mask = [], []
        for k, message in enumerate(messages):
            context = self.render(messages[:k], generation_prompt=message["role"] == "assistant") if k else []
            full = self.render(messages[:k + 1])
            if full[:len(ids)] != ids or full[:len(context)] != context:
                return None
            target = 1 if message["role"] == "assistant" else 0
            mask += [0] * (len(context) - len(ids)) + [target] * (len(full) - len(context))
            ids = full
        return ids, mask


def documents(tokenizer, record, text_field):
    """The documents of one record as (tokens, mask), without end-of-text tokens: one, or for a
    chat under a template that rewrites earlier turns, one per assistant turn."""
    if not isinstance(record, dict):
        raise BadRecord("not a JSON object")
    # Parquet rows hold every column, null where a record has no such field.
    if record.get("messages") is not None:
        messages = record["messages"]
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages):
            raise BadRecord("messages must be a non-empty list of {role, content} strings")
        if not any(m["role"] == "assistant" for m in messages):
            raise BadRecord("a chat without an assistant turn has nothing to learn")
        return tokenizer.chat(messages)
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


def records(path, text_field):
    """(line or row number, record) of one input file."""
    ext = os.path.splitext(path)[1].lower()
    try:
        if ext == ".txt":
            with open(path, encoding="utf-8") as f:
                yield 1, {text_field: f.read()}
        elif ext == ".jsonl":
            with open(path, encoding="utf-8") as f:
                for number, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        yield number, json.loads(line)
                    except json.JSONDecodeError as e:
                        yield number, BadRecord(f"not JSON ({e.msg} at column {e.colno})")
        elif ext == ".parquet":
            try:
                import pyarrow.parquet as pq
            except ImportError:
                fail(f"{path}: reading Parquet needs the pyarrow package")
            try:
                rows = pq.read_table(path).to_pylist()
            except Exception as e:  # a file pyarrow cannot read is the user's
                fail(f"{path}: not a readable Parquet file ({str(e).splitlines()[0]})")
            yield from enumerate(rows, 1)
        else:
            fail(f"{path}: unknown input kind (.txt, .jsonl or .parquet)")
    except OSError as e:
        fail(f"cannot read {path}: {e.strerror}")
    except UnicodeDecodeError as e:
        fail(f"{path} is not valid UTF-8 ({e.reason} at byte {e.start})")


def write(out, tokens, ends, mask, vocab):
    width = 2 if vocab <= 65536 else 4
    tmp = out + ".tmp"
    try:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(tmp, "wb") as f:
            f.write(HEADER.pack(MAGIC, 2, width, len(tokens), vocab, len(ends), FLAG_MASK, 0))
            f.write(struct.pack(f"<{len(tokens)}{'H' if width == 2 else 'I'}", *tokens))
            f.write(struct.pack(f"<{len(ends)}Q", *ends))
            f.write(bytes(mask))
        os.replace(tmp, out)
    except OSError as e:
        if os.path.exists(tmp):
            os.remove(tmp)
        fail(f"cannot write {out}: {e.strerror}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.error = fail
    ap.add_argument("inputs", nargs="+", metavar="INPUT", help=".txt, .jsonl or .parquet files")
    ap.add_argument("--out", required=True, metavar="FILE", help="token file to write")
    ap.add_argument("--tokenizer", metavar="DIR", help="Hugging Face model directory whose tokenizer to use")
    ap.add_argument("--text-field", default="text", help="the field of a plain document record (default: text)")
    ap.add_argument("--skip-bad", action="store_true", help="skip and count bad records instead of stopping")
    args = ap.parse_args()

    tokenizer = HfTokenizer(args.tokenizer) if args.tokenizer else ByteTokenizer()
    tokens, ends, mask, skipped = [], [], [], 0
    progress = sys.stderr.isatty()
    for path in args.inputs:
        for number, record in records(path, args.text_field):
            try:
                if isinstance(record, BadRecord):
                    raise record
                parts = documents(tokenizer, record, args.text_field)
            except BadRecord as e:
                if not args.skip_bad:
                    fail(f"{path}:{number}: {e} (--skip-bad skips such records)")
                skipped += 1
                continue
            for ids, marks in parts:
                # One end-of-text token, learned where the document ends on something learned
                # (not after a chat's closing user turn); a template may have written it already.
                if not ids or ids[-1] != tokenizer.eos_id:
                    ids, marks = ids + [tokenizer.eos_id], marks + [marks[-1] if marks else 1]
                tokens += ids
                mask += marks
                ends.append(len(tokens))
            if progress and len(ends) % 1000 == 0:
                print(f"\rprepare_data: {len(ends)} documents, {len(tokens)} tokens", end="", file=sys.stderr)
    if progress:
        print(file=sys.stderr)
    if not ends:
        fail("no documents in the inputs")
    write(args.out, tokens, ends, mask, tokenizer.vocab_size)
    print(f"wrote {args.out}: {len(ends)} documents, {len(tokens)} tokens ({sum(mask)} targets), "
          f"vocab {tokenizer.vocab_size}" + (f"; skipped {skipped} bad records" if skipped else ""))


if __name__ == "__main__":
    main()
