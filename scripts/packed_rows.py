"""The engine's packing rule (engine/data/packed_documents.h) in Python, for the tests and
benchmarks that hold a peer to the rows fsdpp trains on: a version 2 token file's documents
cut into pieces of at most seq_len tokens, laid out by best fit, longest first."""
import struct


def read_token_file(path):
    """(tokens, document ends, mask bytes or [], vocab) of a version 2 token file."""
    data = open(path, "rb").read()
    magic, version, width, count, vocab, documents, flags, _ = struct.unpack_from("<8sIIQQQII", data)
    if (magic, version) != (b"FSDPTOK\x00", 2):
        raise ValueError(f"{path}: not a version 2 token file")
    tokens = list(struct.unpack_from(f"<{count}{'H' if width == 2 else 'I'}", data, 48))
    ends_at = 48 + width * count
    ends = list(struct.unpack_from(f"<{documents}Q", data, ends_at))
    mask = list(data[ends_at + 8 * documents:]) if flags & 1 else []
    return tokens, ends, mask, vocab


def pieces(ends, mask, seq_len, completion):
    """Every document cut into pieces of at most seq_len tokens, as (begin, length, document
    end, learned targets); a piece learning nothing is left out."""
    out = []
    for begin, end in zip([0] + ends, ends):
        for at in range(begin, end, seq_len):
            length = min(seq_len, end - at)
            targets = min(length, end - at - 1)
            learned = sum(mask[at + 1:at + 1 + targets]) if completion else targets
            if learned:
                out.append((at, length, end, learned))
    return out


def best_fit(all_pieces, seq_len):
    """Rows as the engine lays them out: pieces longest first, each into the row with the least
    room that holds it (the earliest such row on a tie), else a new row."""
    rows, room, placed = [], [], 0  # room: (free slots, when the row got them, row)
    for piece in sorted(all_pieces, key=lambda p: -p[1]):
        fits = [r for r in room if r[0] >= piece[1]]
        if fits:
            best = min(fits)
            room.remove(best)
            free, row = best[0], best[2]
        else:
            free, row = seq_len, len(rows)
            rows.append([])
        rows[row].append(piece)
        if free > piece[1]:
            placed += 1
            room.append((free - piece[1], placed, row))
    return rows
