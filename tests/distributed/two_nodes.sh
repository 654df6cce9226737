#!/usr/bin/env bash
# Two nodes on one machine: two network namespaces joined by a veth pair, `fsdpp launch
# --nnodes 2` in each (2 ranks per node), must finish with the same losses as the same
# 4 ranks launched on one node. Needs root (ip netns); skipped with a message otherwise.
set -uo pipefail
: "${FSDPP:?}" "${WORK:?}"
if [ "$(id -u)" != 0 ] || ! command -v ip >/dev/null; then
  echo "two-node test needs root and iproute2; skipped"; exit 0
fi
bash scripts/make_corpus.sh >/dev/null
out="$WORK/two-nodes"
rm -rf "$out" && mkdir -p "$out"
tag="fsdpp$$"
a="${tag}a" b="${tag}b"
cleanup() { ip netns del "$a" 2>/dev/null; ip netns del "$b" 2>/dev/null; }
trap cleanup EXIT
ip netns add "$a" && ip netns add "$b" || exit 1
ip link add "${tag}0" type veth peer name "${tag}1"
ip link set "${tag}0" netns "$a"
ip link set "${tag}1" netns "$b"
ip -n "$a" addr add 10.213.7.1/24 dev "${tag}0"
ip -n "$b" addr add 10.213.7.2/24 dev "${tag}1"
for ns in "$a" "$b"; do ip -n "$ns" link set lo up; done
ip -n "$a" link set "${tag}0" up
ip -n "$b" link set "${tag}1" up

args=(-- train tests/assets/fsdp-llama.toml --set train.steps=6 --set checkpoint.save_final=false
      --set parallel.timeout_s=60)
common=(--nnodes 2 --nproc-per-node 2 --master-addr 10.213.7.1 --master-port 29731)
GLOO_SOCKET_IFNAME="${tag}0" ip netns exec "$a" "$FSDPP" launch "${common[@]}" --node-rank 0 \
  "${args[@]}" --set "train.out_dir=\"$out/run\"" >"$out/node0.log" 2>&1 &
node0=$!
GLOO_SOCKET_IFNAME="${tag}1" ip netns exec "$b" "$FSDPP" launch "${common[@]}" --node-rank 1 \
  "${args[@]}" --set "train.out_dir=\"$out/run\"" >"$out/node1.log" 2>&1
rc1=$?
wait $node0
rc0=$?
"$FSDPP" launch --nproc-per-node 4 "${args[@]}" --set "train.out_dir=\"$out/one-node\"" >"$out/one-node.log" 2>&1
rc=$?
if [ $rc0 -ne 0 ] || [ $rc1 -ne 0 ] || [ $rc -ne 0 ]; then
  echo "FAIL: exit codes node0 $rc0, node1 $rc1, one node $rc"; tail -n 5 "$out"/*.log; exit 1
fi
python3 - "$out/run/metrics.jsonl" "$out/one-node/metrics.jsonl" <<'PY'
import json, sys
two, one = ([json.loads(l)["loss"] for l in open(p)] for p in sys.argv[1:3])
diff = max(abs(a - b) / abs(b) for a, b in zip(two, one))
print(f"two nodes: {len(two)} steps, final loss {two[-1]:.6f}; one node: final loss {one[-1]:.6f}; "
      f"max relative difference {diff:.2e}")
sys.exit(0 if len(two) == len(one) == 6 and diff < 1e-6 else 1)
PY
