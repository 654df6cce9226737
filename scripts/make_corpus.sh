#!/usr/bin/env bash
# Builds the default example corpus, data/licenses.tok, as byte-level tokens from the licence
# texts that every Debian machine ships in /usr/share/common-licenses, so the examples train
# without downloading anything. Does nothing when the corpus is newer than the tokenizer script.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

src=/usr/share/common-licenses
out=data/licenses.tok
tool=scripts/make_tokens.py

if [ -f "$out" ] && [ "$out" -nt "$tool" ]; then
  echo "make_corpus: $out is up to date"
  exit 0
fi
if [ ! -d "$src" ]; then
  echo "make_corpus: $src not found (it comes with Debian's base-files package)" >&2
  exit 2
fi

# Aliases such as GPL -> GPL-3 would put the same text in twice, so keep the first name
# (in sorted order) under which each real file appears.
declare -A seen=()
inputs=()
while IFS= read -r -d '' f; do
  [ -f "$f" ] || continue
  real="$(realpath -- "$f")"
  [ -n "${seen[$real]:-}" ] && continue
  seen[$real]=1
  inputs+=("$f")
done < <(find "$src" -mindepth 1 -maxdepth 1 -print0 | LC_ALL=C sort -z)

if ((${#inputs[@]} == 0)); then
  echo "make_corpus: no licence files in $src" >&2
  exit 2
fi

mkdir -p data
echo "make_corpus: tokenizing ${#inputs[@]} files from $src"
python3 "$tool" --out "$out" "${inputs[@]}"
