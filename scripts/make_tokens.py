#!/usr/bin/env python3
# Turns text files into an fsdpp token file (the binary format the engine's data loader reads).
# Byte-level mode needs only the standard library so it runs on a bare machine; a HF
# tokenizer.json can be given instead, which requires the `tokenizers` package.
#
# Token file layout, little-endian:
#   magic  8 bytes  b"FSDPTOK\0"
#   version         uint32 (1)
#   bytes_per_token uint32 (2 or 4)
#   token_count     uint64
#   vocab_size      uint64
#   tokens          token_count x uint16/uint32
import argparse
import array
import os
import struct
import sys

# Standard library only, as this script is.
from input_records import TOKEN_MAGIC as MAGIC, Refused, check_out

VERSION = 1
HEADER = struct.Struct("<8sIIQQ")
SEPARATOR = "\n\n"
BYTE_VOCAB = 256


def fail(msg):
    print(f"make_tokens: {msg}", file=sys.stderr)
    sys.exit(2)


def read_bytes(path):
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        fail(f"cannot read {path}: {e.strerror}")


def byte_tokens(paths):
    data = SEPARATOR.encode().join(read_bytes(p) for p in paths)
    return list(data), BYTE_VOCAB


def tokenizer_tokens(paths, tokenizer_path):
    try:
        from tokenizers import Tokenizer
    except ImportError:
        fail("--tokenizer needs the 'tokenizers' package (try the project venv: .venv/bin/python)")
    try:
        tok = Tokenizer.from_file(tokenizer_path)
    except Exception as e:
        fail(f"cannot load tokenizer {tokenizer_path}: {e}")
    texts = []
    for p in paths:
        data = read_bytes(p)
        try:
            texts.append(data.decode("utf-8"))
        except UnicodeDecodeError as e:
            line = data.count(b"\n", 0, e.start) + 1
            fail(f"{p}:{line}: not valid UTF-8 ({e.reason} at byte {e.start})")
    # Special tokens such as BOS are left out so the stream is exactly the text.
    ids = tok.encode(SEPARATOR.join(texts), add_special_tokens=False).ids
    # A vocabulary whose ids skip values holds ids at or past its size.
    return ids, max([tok.get_vocab_size(), *(i + 1 for i in ids)])


def pack(tokens, width):
    typecode = next(c for c in "HIL" if array.array(c).itemsize == width)
    arr = array.array(typecode, tokens)
    if sys.byteorder == "big":
        arr.byteswap()
    return arr


def main():
    ap = argparse.ArgumentParser(
        description="Tokenize text files into an fsdpp token file. Inputs are concatenated in "
        "the order given, separated by a blank line. Without --tokenizer every byte is one "
        "token (vocab 256).")
    ap.error = fail
    ap.add_argument("inputs", nargs="+", metavar="INPUT", help="text files to tokenize")
    ap.add_argument("--out", required=True, metavar="FILE", help="token file to write")
    ap.add_argument("--tokenizer", metavar="JSON",
                    help="HF tokenizer.json to use instead of byte-level tokens")
    ap.add_argument("--dtype", choices=["auto", "uint16", "uint32"], default="auto",
                    help="token width; auto picks uint16 when the vocab fits (default: auto)")
    args = ap.parse_args()
    try:  # before any work: an input, or a file of the user's that is no token file, is left alone
        check_out(args.out, args.inputs)
    except Refused as e:
        fail(str(e))

    if args.tokenizer:
        tokens, vocab = tokenizer_tokens(args.inputs, args.tokenizer)
    else:
        tokens, vocab = byte_tokens(args.inputs)

    dtype = args.dtype
    if dtype == "auto":
        dtype = "uint16" if vocab <= 65536 else "uint32"
    if dtype == "uint16" and vocab > 65536:
        fail(f"vocab {vocab} does not fit in uint16; use --dtype uint32")
    width = 2 if dtype == "uint16" else 4

    # A temporary file of this process's own beside the target, renamed over it: concurrent
    # writers of the same corpus (tests run two at a time) each leave a whole file.
    tmp = f"{args.out}.{os.getpid()}.tmp"
    try:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(tmp, "wb") as f:
            f.write(HEADER.pack(MAGIC, VERSION, width, len(tokens), vocab))
            pack(tokens, width).tofile(f)
        os.replace(tmp, args.out)
    except OSError as e:
        if os.path.exists(tmp):
            os.remove(tmp)
        fail(f"cannot write {args.out}: {e.strerror}")

    print(f"wrote {args.out}: {len(tokens)} tokens, vocab {vocab}, {dtype}")


if __name__ == "__main__":
    main()
