"""The records of prepare_data.py's input files: .txt files whole, JSONL line by line, Parquet
row by row, each with its line or row number and how far it got into the file (for the
progress bar); the errors that refuse a record or the whole run; and check_out, which keeps a
token-file writer (prepare_data.py, make_tokens.py) off its inputs and the user's other files."""
import codecs
import json
import os

KINDS = (".txt", ".jsonl", ".parquet")
TOKEN_MAGIC = b"FSDPTOK\x00"  # every version of the token file opens with it


class BadRecord(Exception):
    pass


class Refused(Exception):
    """Ends the run with the message and exit status 2, once every progress bar is closed."""


def fail(message):
    raise Refused(message)


def first_line(e):
    return (str(e).splitlines() or [type(e).__name__])[0]


class PlainText(str):
    """A .txt file's text: one document, whatever --text-field names."""


def decode(path, data, at, line=1):
    """data, the bytes at offset `at` of path, which begin its line `line`, as text; a leading
    byte-order mark dropped."""
    skip = len(codecs.BOM_UTF8) if at == 0 and data.startswith(codecs.BOM_UTF8) else 0
    try:
        return data[skip:].decode("utf-8")
    except UnicodeDecodeError as e:
        line += data.count(b"\n", 0, skip + e.start)
        fail(f"{path}:{line}: not valid UTF-8 ({e.reason} at byte {at + skip + e.start})")


def open_input(path):
    """(size, unit, records) of one input file: its bytes (.txt, .jsonl) or rows (.parquet),
    and an iterator of (line or row number, record, bytes or rows read); a blank line's
    record is None, a line that is not JSON's a BadRecord."""
    ext = os.path.splitext(path)[1].lower()
    try:
        f = open(path, "rb")
    except OSError as e:
        fail(f"cannot read {path}: {e.strerror}")
    if ext != ".parquet":
        return os.fstat(f.fileno()).st_size, "B", text_records(path, f, ext)
    try:
        import pyarrow.parquet as pq
    except ImportError:
        f.close()
        fail(f"{path}: reading Parquet needs the pyarrow package")
    try:
        table = pq.ParquetFile(f)
        rows = table.metadata.num_rows
    except Exception as e:  # a file pyarrow cannot read is the user's
        f.close()
        fail(f"{path}: not a readable Parquet file ({first_line(e)})")
    return rows, "row", parquet_records(path, f, table)


def unicode_text(record):
    """Whether every string of a JSON record is text UTF-8 can hold: JSON's escapes can spell
    half a surrogate pair, which Python keeps and no tokenizer can encode."""
    try:
        json.dumps(record, ensure_ascii=False).encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def text_records(path, f, ext):
    with f:
        try:
            if ext == ".txt":
                data = f.read()
                yield 1, PlainText(decode(path, data, 0)), len(data)
                return
            at = 0
            for number, line in enumerate(f, 1):
                try:
                    text = line.decode("utf-8") if at else decode(path, line, 0)
                except UnicodeDecodeError:
                    decode(path, line, at, number)  # refuses the file, naming the line and byte
                read = len(line)
                at += read
                if not text.strip():
                    yield number, None, read
                    continue
                try:
                    record = json.loads(text)
                except json.JSONDecodeError as e:
                    record = BadRecord(f"not JSON ({e.msg} at column {e.colno})")
                if "\\u" in text and not isinstance(record, BadRecord) and not unicode_text(record):
                    record = BadRecord("holds an escape of half a surrogate pair (such as \\ud800), which is no character")
                yield number, record, read
        except OSError as e:
            fail(f"cannot read {path}: {e.strerror}")


def parquet_records(path, f, table):
    with f:
        batches, number = table.iter_batches(batch_size=1024), 0
        while True:
            try:
                batch = next(batches, None)
                rows = None if batch is None else batch.to_pylist()
            except Exception as e:  # a damaged page past the footer
                fail(f"{path}: not a readable Parquet file ({first_line(e)})")
            if rows is None:
                return
            for row in rows:
                number += 1
                yield number, row, 1


def check_out(out, inputs):
    """The output replaces only a token file, and never an input."""
    if not os.path.exists(out):
        return
    if any(os.path.exists(path) and os.path.samefile(path, out) for path in inputs):
        fail(f"--out {out}: is one of the inputs, which writing it would destroy; choose another file")
    if not os.path.isfile(out):
        fail(f"--out {out}: exists and is not a file")
    try:
        with open(out, "rb") as f:
            head = f.read(len(TOKEN_MAGIC))
    except OSError as e:
        fail(f"--out {out}: cannot read it to check it is a token file ({e.strerror})")
    if head and head != TOKEN_MAGIC:  # an empty file (mktemp's) holds nothing to lose
        fail(f"--out {out}: holds something other than a token file, which writing it would destroy; "
             "choose another file")
