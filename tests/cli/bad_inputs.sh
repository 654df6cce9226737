#!/usr/bin/env bash
# Bad input to the real binary: each case must end with exit status 2 and exactly one line
# on stderr that starts "fsdpp: error:" and names what is wrong (file, line or tensor).
set -uo pipefail
: "${FSDPP:?}" "${FIXTURES:?}" "${WORK:?}" "${PYTHON:?}"
work="$WORK/bad-inputs"
rm -rf "$work" && mkdir -p "$work"
# Tokens within the fixture's vocabulary of 101, so the data is not what a case trips on.
python3 -c 'import struct, sys; t = [i % 101 for i in range(2000)]
open(sys.argv[1], "wb").write(b"FSDPTOK\0" + struct.pack("<IIQQ", 1, 2, len(t), 101) + struct.pack(f"<{len(t)}H", *t))' \
  "$work/ok.tok" || exit 1

cat >"$work/ok.toml" <<TOML
[model]
path = "$FIXTURES/llama_untied"
[data]
train = "$work/ok.tok"
seq_len = 16
batch_size = 2
[train]
steps = 1
out_dir = "$work/out"
TOML

failures=0
# expect NAME PATTERN... -- fsdpp ARGS...: every PATTERN must occur in the one stderr line
# besides info lines.
expect() {
  local name=$1; shift
  local patterns=()
  while [ "$1" != "--" ]; do patterns+=("$1"); shift; done
  shift
  "$FSDPP" "$@" >"$work/out.txt" 2>"$work/all-err.txt"
  local rc=$? lines
  # A refusal made once the model is loaded follows the run's own info lines; nothing else may.
  grep -vE '^(\[rank [0-9]+\] )?[0-9]{2}:[0-9]{2}:[0-9]{2} info ' "$work/all-err.txt" >"$work/err.txt"
  lines=$(wc -l <"$work/err.txt")
  local ok=1
  [ "$rc" -eq 2 ] || ok=0
  [ "$lines" -eq 1 ] || ok=0
  grep -q '^fsdpp: error: ' "$work/err.txt" || ok=0
  for p in "${patterns[@]}"; do grep -qF -- "$p" "$work/err.txt" || ok=0; done
  if [ $ok -eq 1 ]; then
    echo "ok   $name: $(cat "$work/err.txt")"
  else
    echo "FAIL $name (exit $rc, $lines stderr lines, wanted: ${patterns[*]}):"
    cat "$work/err.txt"
    failures=$((failures + 1))
  fi
}

sed 's/^seq_len = 16/seq_lne = 16/' "$work/ok.toml" >"$work/unknown_key.toml"
expect "unknown TOML key" "unknown_key.toml:5" "[data] seq_lne: unknown key; did you mean 'seq_len'?" \
  -- train "$work/unknown_key.toml"

sed 's/^batch_size = 2/batch_size = "two"/' "$work/ok.toml" >"$work/wrong_type.toml"
expect "wrong TOML type" "wrong_type.toml:6" "expected an integer, got a string" \
  -- train "$work/wrong_type.toml"

expect "unknown --set key" "--set train.stpes=3" "did you mean 'steps'?" \
  -- train "$work/ok.toml" --set train.stpes=3

expect "evaluation with nothing held out" "[train] eval_every = 3 evaluates the held-out part" \
  -- train "$work/ok.toml" --set train.eval_every=3
# Windows of one token have nothing to predict: refused at start, not at the first evaluation.
for command in train eval; do
  expect "$command evaluating windows of one token" "--set data.seq_len=1: [data] seq_len = 1 leaves an evaluation window no token" \
    -- $command "$work/ok.toml" --set data.seq_len=1 --set data.eval_fraction=0.1 --set train.eval_every=2
done
# fsdpp eval follows no schedule: with nothing held out it scores all of [data] train.
"$FSDPP" eval "$work/ok.toml" --set train.eval_every=3 >"$work/eval.out" 2>&1 ||
  { echo "FAIL eval refused [train] eval_every with nothing held out: $(tail -1 "$work/eval.out")"; failures=$((failures + 1)); }

# Training windows hold seq_len + 1 tokens (inputs and the targets one on); evaluation's hold
# seq_len, predicting tokens 2..seq_len, so eval scores a file of exactly seq_len tokens. A
# fraction that leaves too little to train is named, not the file.
python3 -c 'import struct, sys; t = [i % 101 for i in range(16)]
open(sys.argv[1], "wb").write(b"FSDPTOK\0" + struct.pack("<IIQQ", 1, 2, len(t), 101) + struct.pack(f"<{len(t)}H", *t))' \
  "$work/exact.tok" || exit 1
"$FSDPP" eval "$work/ok.toml" --tokens "$work/exact.tok" >"$work/eval.out" 2>&1 &&
  grep -q '^eval: 1 windows of 16 tokens, 15 predicted' "$work/eval.out" ||
  { echo "FAIL eval of exactly seq_len tokens: $(tail -1 "$work/eval.out")"; failures=$((failures + 1)); }
expect "training on exactly seq_len tokens" "exact.tok: 16 tokens cannot fill one training window of seq_len 16 + 1" \
  -- train "$work/ok.toml" --set "data.train=\"$work/exact.tok\""
expect "an eval_fraction that leaves too little to train" \
  "ok.tok: [data] eval_fraction 0.9999 of 2000 tokens leaves 1 to train, fewer than one training window of seq_len 16 + 1" \
  -- train "$work/ok.toml" --set data.eval_fraction=0.9999

expect "an open range's end" "[data] eval_fraction: must be a finite number in [0, 1), got 1" \
  -- train "$work/ok.toml" --set data.eval_fraction=1
expect "below an open range" "[data] eval_fraction: must be a finite number in [0, 1), got -1e-09" \
  -- train "$work/ok.toml" --set data.eval_fraction=-1e-9
expect "a beta that never forgets" "[optimizer] beta2: must be a finite number in [0, 1), got 1" \
  -- train "$work/ok.toml" --set optimizer.beta2=1.0

expect "a --set past 64-bit integers" "--set train.steps=9223372036854775808: invalid TOML value" \
  -- train "$work/ok.toml" --set train.steps=9223372036854775808
expect "a --set past a value" "--set train.steps.x=1: train.steps is a value, not a table of keys" \
  -- train "$work/ok.toml" --set train.steps.x=1

expect "unknown train_on" "[data] train_on: 'prompts' is not one of all, completion" \
  -- train "$work/ok.toml" --set 'data.train_on="prompts"'

expect "completion without a loss mask" "ok.tok: [data] train_on = \"completion\" needs a token file with a loss mask" \
  -- train "$work/ok.toml" --set 'data.train_on="completion"'

expect "packing = false on a stream without document ends" \
  "ok.tok: [data] packing = false gives each document a row, and this file is one stream" \
  -- train "$work/ok.toml" --set data.packing=false

# Text-only samples, none marking a prompt, and a pixel file without tensors.
mkdir -p "$work/dataset" && printf '{"input_ids": [1, 2, 3]}\n' >"$work/dataset/samples.jsonl"
printf '\002\000\000\000\000\000\000\000{}' >"$work/dataset/pixels.safetensors"
expect "completion on a multimodal dataset without prompts" \
  "dataset/samples.jsonl: [data] train_on = \"completion\" learns what follows each sample's prompt, and no sample" \
  -- train "$work/ok.toml" --set "data.train=\"$work/dataset\"" --set 'data.train_on="completion"' \
  --set 'model.path="tests/assets/models/tiny-qwen2-vl"'

expect "unknown device" "[parallel] device: 'tpu' is not one of auto, cpu, cuda" \
  -- train "$work/ok.toml" --set 'parallel.device="tpu"'

expect "backend for another device" "nccl runs on GPUs, but device is 'cpu'" \
  -- train "$work/ok.toml" --set 'parallel.device="cpu"' --set 'parallel.backend="nccl"'

# What a command does not read, it does not check: a plan and an evaluation resume nothing.
# A plan reads an adapter's config (the LoRA it puts on), so a missing one is refused.
for command in plan eval; do
  "$FSDPP" $command "$work/ok.toml" --set "checkpoint.resume=\"$work/no-such-checkpoint\"" >/dev/null \
    2>"$work/unread.err" ||
    { echo "FAIL $command checked a path it does not read: $(tail -1 "$work/unread.err")"; failures=$((failures + 1)); }
done
expect "a plan with a missing adapter" "[model] adapter: $work/no-such-adapter: no such directory" \
  -- plan "$work/ok.toml" --set "model.adapter=\"$work/no-such-adapter\""
for command in train plan eval; do
  expect "$command with a missing model dir" \
    "--set model.path=\"$work/no-such-model\": [model] path: $work/no-such-model: no such file or directory" \
    -- $command "$work/ok.toml" --set "model.path=\"$work/no-such-model\""
done
# A path error names the key, where it was set and, for a relative path, what it resolves against.
expect "missing relative data file" \
  "--set data.train=\"data/licences.tok\": [data] train: data/licences.tok: no such file or directory (relative paths resolve against the working directory $PWD)" \
  -- train "$work/ok.toml" --set 'data.train="data/licences.tok"'
sed "s|^train = .*|train = \"data/licences.tok\"|" "$work/ok.toml" >"$work/relative_data.toml"
expect "missing data file named in the run file" "relative_data.toml:4: [data] train: data/licences.tok: no such file or directory" \
  -- train "$work/relative_data.toml"
expect "unknown section by --set" "--set trainn.steps=3: unknown section [trainn]; did you mean 'train'?" \
  -- train "$work/ok.toml" --set trainn.steps=3
expect "a key in the wrong section" "--set train.lr=0.1: [train] lr: unknown key; lr is a key of [optimizer]" \
  -- train "$work/ok.toml" --set train.lr=0.1
printf '[model]\npath = "%s\n' "$FIXTURES/llama_untied" >"$work/unclosed.toml"
expect "an unclosed quote" "unclosed.toml:2: invalid TOML: a quoted string is not closed on its line (a missing quote?)" \
  -- train "$work/unclosed.toml"
{ cat "$work/ok.toml"; printf '# a comment \0 cut by a NUL\n'; } >"$work/nul.toml"
expect "an unknown option in a --set table" "--set policy.options={x=1}: [policy.options] x: the policy policies/llama.lua has no such option" \
  -- plan "$work/ok.toml" --set 'policy.options={x=1}'
expect "a wrong option type in a --set table" "--set policy.options={lora_rank=\"a\"}: [policy.options] lora_rank: must be an integer" \
  -- plan "$work/ok.toml" --set 'policy.options={lora_rank="a"}'
expect "a NUL in a comment" "nul.toml:$(($(wc -l <"$work/ok.toml") + 1)): holds a NUL byte (not a text file?)" -- train "$work/nul.toml"
expect "launch without --" "launch: put '--' before the command each rank runs: fsdpp launch ... -- train ..." \
  -- launch --nproc-per-node 2 train "$work/ok.toml"
expect "a master address that does not resolve" \
  "launch: --master-addr no.such.host.invalid does not resolve" \
  -- launch --nnodes 2 --node-rank 1 --nproc-per-node 1 --master-addr no.such.host.invalid -- train "$work/ok.toml"
if ! command -v nvidia-smi >/dev/null; then
  expect "a GPU where there is none" \
    "[parallel] device = \"cuda\", but this process sees no GPU; use device = \"cpu\"" \
    -- train "$work/ok.toml" --set 'parallel.device="cuda"'
  # The setting that asked for the GPU is the one named, where nccl implies it.
  expect "nccl where there is no GPU" \
    "--set parallel.backend=\"nccl\": [parallel] backend = \"nccl\", but this process sees no GPU" \
    -- train "$work/ok.toml" --set 'parallel.backend="nccl"'
  # eval reads [parallel] as train does, alone and as ranks of a launch.
  expect "eval on a GPU where there is none" \
    "--set parallel.device=\"cuda\": [parallel] device = \"cuda\", but this process sees no GPU" \
    -- eval "$work/ok.toml" --set 'parallel.device="cuda"'
  expect "eval over nccl where there is no GPU" "[parallel] backend = \"nccl\", but this process sees no GPU" \
    -- eval "$work/ok.toml" --set 'parallel.backend="nccl"'
  # Both ranks refuse; whichever reports first is named, as the launcher stops the other.
  expect "launched eval on a GPU where there is none" "fsdpp: error: rank " \
    ": --set parallel.device=\"cuda\": [parallel] device = \"cuda\", but this process sees no GPU" \
    -- launch --nproc-per-node 2 -- eval "$work/ok.toml" --set 'parallel.device="cuda"'
fi

# eval shards nothing: each rank of a launch would score everything again and print it again.
expect "a launched eval" "fsdpp: error: rank " ": eval: runs as one process (it shards nothing)" \
  "run fsdpp eval without fsdpp launch or torchrun" -- launch --nproc-per-node 2 -- eval "$work/ok.toml" --json

cp -r "$FIXTURES/llama_untied" "$work/corrupt_model"
printf '\xff\xff\xff\xff' | dd of="$work/corrupt_model/model.safetensors" bs=1 seek=4 conv=notrunc 2>/dev/null
expect "corrupt safetensors header" "corrupt_model/model.safetensors" "corrupt safetensors header" \
  -- train "$work/ok.toml" --set "model.path=\"$work/corrupt_model\""

cp -r "$FIXTURES/llama_untied" "$work/short_model"
truncate -s -100 "$work/short_model/model.safetensors"
expect "truncated safetensors data" "short_model/model.safetensors" "past the end of the file" \
  -- eval "$work/ok.toml" --set "model.path=\"$work/short_model\""

head -c 100 "$work/ok.tok" >"$work/truncated.tok"
expect "truncated token file" "truncated.tok" "truncated" \
  -- train "$work/ok.toml" --set "data.train=\"$work/truncated.tok\""

expect "resume from a missing checkpoint" "[checkpoint] resume: $work/no-such-checkpoint: no such file or directory" \
  -- train "$work/ok.toml" --set "checkpoint.resume=\"$work/no-such-checkpoint\""
expect "resume from a non-checkpoint" "$work/corrupt_model is not a complete checkpoint" \
  -- train "$work/ok.toml" --set "checkpoint.resume=\"$work/corrupt_model\""
expect "export dtype" "[checkpoint] export_dtype" "float8" -- train "$work/ok.toml" --set 'checkpoint.export_dtype="float8"'
expect "export of a missing checkpoint" "$work/no-such-checkpoint: no such checkpoint directory" \
  -- export "$work/no-such-checkpoint" "$work/exported"
expect "export without OUT" "export: needs CHECKPOINT and OUT" -- export "$work/no-such-checkpoint"

expect "missing config" "nothing.toml: no such config file" -- train "$work/nothing.toml"
expect "unknown command" "unknown command 'trian'" -- trian "$work/ok.toml"
expect "unknown option" "unknown option --fast" -- train "$work/ok.toml" --fast

# Values are range-checked where they enter: non-finite floats, integers too large for a
# float key, sizes a run cannot hold, threads the machine lacks, a --set smuggling TOML.
expect "infinite lr" "--set optimizer.lr=inf" "[optimizer] lr: must be a finite number" \
  -- train "$work/ok.toml" --set optimizer.lr=inf
expect "NaN weight_decay" "[optimizer] weight_decay: must be a finite number" \
  -- train "$work/ok.toml" --set optimizer.weight_decay=nan
expect "NaN beta2" "[optimizer] beta2: must be a finite number" -- train "$work/ok.toml" --set optimizer.beta2=nan
expect "infinite eps" "[optimizer] eps: must be a finite number" -- train "$work/ok.toml" --set optimizer.eps=inf
expect "an unknown host update" "[optimizer] host_update: 'later' is not one of auto, overlapped, in_step" \
  -- train "$work/ok.toml" --set 'optimizer.host_update="later"'
expect "integer too large for a float key" "[optimizer] lr: must be a finite number in [0, 1e+06]" \
  -- train "$work/ok.toml" --set optimizer.lr=9223372036854775807
expect "infinite clip_grad_norm" "[train] clip_grad_norm: must be a finite number" \
  -- train "$work/ok.toml" --set train.clip_grad_norm=inf
expect "NaN eval_fraction" "[data] eval_fraction: must be a finite number" \
  -- train "$work/ok.toml" --set data.eval_fraction=nan
expect "threads beyond the machine" "[train] threads: must be in [0," -- train "$work/ok.toml" --set train.threads=100000
expect "huge batch_size" "[data] batch_size: must be in [1, 4294967296]" \
  -- train "$work/ok.toml" --set data.batch_size=9223372036854775807
expect "batch x seq_len beyond a step" "[data] batch_size: a global batch of 65537 x 65536 tokens" \
  -- train "$work/ok.toml" --set data.batch_size=65537 --set data.seq_len=65536
expect "huge grad_accum" "[train] grad_accum: must be in [1, 1000000]" \
  -- train "$work/ok.toml" --set train.grad_accum=9223372036854775807
expect "--set with a line break" "--set train.steps=1\n[evil]\nx=1: holds a line break" \
  -- train "$work/ok.toml" --set "$(printf 'train.steps=1\n[evil]\nx=1')"
expect "port out of range" "launch: --master-port takes a whole number in [1, 65535], got '70000'" \
  -- launch --master-port 70000 --nproc-per-node 1 -- train "$work/ok.toml"
expect "ranks beyond the machine" "launch: --nproc-per-node takes a whole number in [1," \
  -- launch --nproc-per-node 100000 -- train "$work/ok.toml"
expect "no command" "no command given" --
# Both ranks fail alike; whichever the launcher sees first is the one named.
expect "a user error in launched ranks" "fsdpp: error: rank " ": --set optimizer.lr=inf: [optimizer] lr" \
  -- launch --nproc-per-node 2 -- train "$work/ok.toml" --set optimizer.lr=inf

# float16's loss scale.
expect "a loss-scale mode misspelt" "[loss_scale] mode: 'dynmaic' is not one of auto, dynamic, off" \
  -- train "$work/ok.toml" --set 'loss_scale.mode="dynmaic"'
expect "a loss scale that does not grow" "[loss_scale] growth_factor: must be above 1, got 1" \
  -- train "$work/ok.toml" --set loss_scale.growth_factor=1

# Mixture-of-experts settings and configs.
expect "routing-bias update for a model without routing biases" "--set experts.bias_update_rate=0.001: [experts] bias_update_rate" "model_type 'llama'" \
  -- train "$work/ok.toml" --set experts.bias_update_rate=0.001
expect "a plan's routing-bias update for a model without routing biases" \
  "--set experts.bias_update_rate=0.001: [experts] bias_update_rate" -- plan "$work/ok.toml" --set experts.bias_update_rate=0.001
expect "negative routing-bias rate" "[experts] bias_update_rate: must be a finite number in [0, 1]" \
  -- train "$work/ok.toml" --set experts.bias_update_rate=-1
mkdir -p "$work/bad_groups"
sed 's/"n_group": 4/"n_group": 5/' tests/assets/models/fsdp-deepseek-v3/config.json >"$work/bad_groups/config.json"
expect "experts that do not split into groups" "bad_groups/config.json" "n_routed_experts 96 must split into n_group 5" \
  -- train "$work/ok.toml" --set "model.path=\"$work/bad_groups\""
mkdir -p "$work/bad_top_k"
sed 's/"num_experts_per_tok": 2/"num_experts_per_tok": 97/' tests/assets/models/fsdp-qwen3-moe/config.json \
  >"$work/bad_top_k/config.json"
expect "more experts per token than experts" "bad_top_k/config.json" "num_experts_per_tok must be in [1, 96], got 97" \
  -- train "$work/ok.toml" --set "model.path=\"$work/bad_top_k\""

expect "a held-out part smaller than one window" "ok.tok: [data] eval_fraction 0.005 holds out 10 of 2000 tokens" \
  -- train "$work/ok.toml" --set data.eval_fraction=0.005

# Widths that do not fit together: a derived head width, a vision tower's output.
mkdir -p "$work/uneven_heads" "$work/vision_width" "$work/merge_width" "$work/wide_latent"
python3 - "$FIXTURES/llama_untied" "$work" <<'PY' || exit 1
import json, sys
source, work = sys.argv[1:3]
c = json.load(open(source + "/config.json"))
c.pop("head_dim", None)
c.update(num_attention_heads=7, num_key_value_heads=7)
json.dump(c, open(work + "/uneven_heads/config.json", "w"))
vl = json.load(open("tests/assets/models/tiny-qwen2-vl/config.json"))
width = vl["vision_config"]["hidden_size"]
vl["vision_config"]["hidden_size"] = width + 16
json.dump(vl, open(work + "/vision_width/config.json", "w"))
vl["vision_config"].update(hidden_size=width, spatial_merge_size=2**20)
json.dump(vl, open(work + "/merge_width/config.json", "w"))
ds = json.load(open("tests/assets/models/fsdp-deepseek-v3/config.json"))
ds.update(q_lora_rank=2**20, kv_lora_rank=2**20, qk_nope_head_dim=2**20, v_head_dim=2**20)
json.dump(ds, open(work + "/wide_latent/config.json", "w"))
PY
expect "hidden_size not a multiple of the heads" "uneven_heads/config.json: hidden_size 48 is not a multiple of num_attention_heads 7" \
  -- train "$work/ok.toml" --set "model.path=\"$work/uneven_heads\""
expect "a vision tower wider than the text model" "vision_width/config.json: vision_config's output width" \
  "differs from the language model's hidden_size" -- plan "$work/ok.toml" --set "model.path=\"$work/vision_width\""
expect "latent attention past the parameter bound" "wide_latent/config.json: describes a model of about 29687B parameters" \
  -- plan "$work/ok.toml" --set "model.path=\"$work/wide_latent\""
expect "a merger wider than any product" "merge_width/config.json: vision_config: width x spatial_merge_size^2" \
  -- plan "$work/ok.toml" --set "model.path=\"$work/merge_width\""

# A model past the host's memory, under a limit on the address space so that the allocator
# refuses it on any machine (overcommit could otherwise grant it and the kernel kill the run).
mkdir -p "$work/too_large"
python3 -c 'import json, sys; c = json.load(open(sys.argv[1] + "/config.json"))
c.update(vocab_size=2**24, hidden_size=8192, num_attention_heads=64, num_key_value_heads=64)
json.dump(c, open(sys.argv[2] + "/config.json", "w"))' "$FIXTURES/llama_untied" "$work/too_large" || exit 1
(ulimit -v 16000000 && before=$failures &&
  expect "a model past the host's memory" "out of host memory" "you tried to allocate 549755813888 bytes" \
    -- train "$work/ok.toml" --set "model.path=\"$work/too_large\"" && [ "$failures" -eq "$before" ]) ||
  failures=$((failures + 1))

# JSON nested deeper than any file needs, which would overflow the stack of whatever copies,
# prints or frees it: an unused config.json key, a safetensors tensor's shape.
mkdir -p "$work/deep_config" "$work/deep_shape"
python3 - "$FIXTURES/llama_untied" "$work" <<'PY' || exit 1
import json, struct, sys
source, work = sys.argv[1:3]
deep = "[" * 100000 + "]" * 100000
config = open(source + "/config.json").read()
open(work + "/deep_config/config.json", "w").write(config.rstrip().rstrip("}") + ', "unused": ' + deep + "}")
open(work + "/deep_shape/config.json", "w").write(config)
data = open(source + "/model.safetensors", "rb").read()
size = struct.unpack("<Q", data[:8])[0]
header = json.loads(data[8:8 + size])
header["model.norm.weight"]["shape"] = "DEEP"
text = json.dumps(header).replace('"DEEP"', deep).encode()
text += b" " * (-len(text) % 8)
open(work + "/deep_shape/model.safetensors", "wb").write(struct.pack("<Q", len(text)) + text + data[8 + size:])
PY
expect "config.json nested 100,000 deep" "deep_config/config.json: nested deeper than 64 levels" \
  -- train "$work/ok.toml" --set "model.path=\"$work/deep_config\""
expect "a safetensors shape nested 100,000 deep" "deep_shape/model.safetensors: corrupt safetensors header: nested deeper than 64" \
  -- train "$work/ok.toml" --set "model.path=\"$work/deep_shape\""

# A torchrun-style environment: each variable range-checked where it enters.
MASTER_PORT=65536 RANK=0 WORLD_SIZE=2 expect "MASTER_PORT past 16 bits" \
  "environment: MASTER_PORT='65536' is not a whole number in [1, 65535]" -- train "$work/ok.toml"
RANK=0 WORLD_SIZE=4294967297 expect "WORLD_SIZE past int" "environment: WORLD_SIZE='4294967297' is not a whole number" \
  -- train "$work/ok.toml"
RANK=1 expect "RANK without WORLD_SIZE" "environment: RANK is set and WORLD_SIZE is not; a launcher sets both" \
  -- train "$work/ok.toml"
# A batch script that exports WORLD_SIZE beside Slurm's own variables trains as Slurm says,
# and exports as one process within its allocation.
SLURM_PROCID=0 SLURM_NTASKS=1 SLURM_NTASKS_PER_NODE=8 WORLD_SIZE=1 "$FSDPP" train "$work/ok.toml" \
  --set "train.out_dir=\"$work/slurm\"" --set train.steps=1 >"$work/slurm.log" 2>&1 ||
  { echo "FAIL a Slurm step with WORLD_SIZE exported: $(tail -1 "$work/slurm.log")"; failures=$((failures + 1)); }
SLURM_PROCID=0 SLURM_NTASKS=4 "$FSDPP" export "$work/slurm/checkpoints/step-00000001" "$work/slurm-export" \
  >"$work/slurm.log" 2>&1 ||
  { echo "FAIL an export inside a Slurm allocation: $(tail -1 "$work/slurm.log")"; failures=$((failures + 1)); }
# An export works beside its directory, in .partial-OUT: what an interrupted export left there
# is cleared, a directory of the user's of that name refused and kept.
mkdir -p "$work/.partial-kept" "$work/.partial-cleared" && echo mine >"$work/.partial-kept/notes.txt"
touch "$work/.partial-cleared/.fsdpp-export-staging" "$work/.partial-cleared/model.safetensors"
expect "a directory of the user's where an export stages" \
  "$work/.partial-kept: is in the way of the export to $work/kept, which works beside it under that name, and is not an export's" \
  -- export "$work/slurm/checkpoints/step-00000001" "$work/kept"
[ "$(cat "$work/.partial-kept/notes.txt" 2>/dev/null)" = mine ] ||
  { echo "FAIL a refused export lost the user's .partial-kept"; failures=$((failures + 1)); }
"$FSDPP" export "$work/slurm/checkpoints/step-00000001" "$work/cleared" >"$work/slurm.log" 2>&1 &&
  [ ! -e "$work/.partial-cleared" ] && [ -f "$work/cleared/model.safetensors" ] ||
  { echo "FAIL an interrupted export's staging directory was not cleared: $(tail -1 "$work/slurm.log")"
    failures=$((failures + 1)); }
expect "--adapter of a checkpoint without adapters" \
  "export: --adapter, but $work/slurm/checkpoints/step-00000001 holds no LoRA adapters" \
  -- export "$work/slurm/checkpoints/step-00000001" "$work/adapter-out" --adapter
expect "--merge-lora beside --adapter" "export: --merge-lora writes the merged model and --adapter the adapters alone" \
  -- export "$work/slurm/checkpoints/step-00000001" "$work/adapter-out" --adapter --merge-lora
RANK=0 WORLD_SIZE=1 LOCAL_RANK=7 LOCAL_WORLD_SIZE=2 expect "LOCAL_RANK past LOCAL_WORLD_SIZE" \
  "environment: LOCAL_RANK 7 of LOCAL_WORLD_SIZE 2 does not fit a world of 1" -- train "$work/ok.toml"

# Mesh sizes whose product wraps in 32 bits; a policy that plans otherwise on each rank.
expect "mesh sizes whose product wraps" "policies/llama.lua:4: mesh replicate 2147483647 × shard 2147483647 ≠ world 1" \
  -- plan "$work/ok.toml" --set policy.options.shard_size=2147483647 --set policy.options.replicate=2147483647
printf 'wrap(ctx.model:get("model.layers." .. ctx.rank))\n' >"$work/by_rank.lua"
expect "a plan that differs by rank" "rank 1's plan differs from rank 0's" "whatever ctx.rank" \
  -- launch --nproc-per-node 2 -- train "$work/ok.toml" --set "policy.name=\"$work/by_rank.lua\""

# LoRA.
expect "LoRA rank 0" "--set policy.options.lora_rank=0: [policy.options] lora_rank: must be an integer in [1, 65536], got 0" \
  -- train "$work/ok.toml" --set policy.options.lora_rank=0

# Policy options: each one the policy does not declare, or a value it does not accept, is
# blamed on the run file's line or the --set that gave it.
expect "policy option typo by --set" \
  "--set policy.options.lora_rnak=8: [policy.options] lora_rnak: the policy policies/llama.lua has no such option; did you mean 'lora_rank'?" \
  -- train "$work/ok.toml" --set policy.options.lora_rnak=8
cp "$work/ok.toml" "$work/options.toml"
printf '[policy.options]\nshard_size = 1\nofload = "cpu"\n' >>"$work/options.toml"
expect "policy option typo in the file" \
  "options.toml:12: [policy.options] ofload: the policy policies/llama.lua has no such option; did you mean 'offload'?" \
  -- train "$work/options.toml"
expect "policy option typo in plan" "options.toml:12: [policy.options] ofload:" -- plan "$work/options.toml" --world 2
expect "policy option value" "--set policy.options.shard_size=\"all\": [policy.options] shard_size: must be -1, an integer >= 1 or \"auto\", got \"all\"" \
  -- train "$work/ok.toml" --set 'policy.options.shard_size="all"'
# Float8 products: refused where the run's device has no FP8 matrix units (every CPU), and
# where the unit does not gather in bf16.
expect "fp8 on a CPU" 'policies/llama.lua' 'declares precision compute = "fp8", which needs a GPU with FP8 matrix units' \
  'this run computes on cpu' \
  -- train "$work/ok.toml" --set 'policy.options.param_dtype="bf16"' --set 'policy.options.compute="fp8"'
expect "fp8 over float32" 'policies/llama.lua' 'precision compute = "fp8" needs param = "bfloat16"' 'computes in float32' \
  -- train "$work/ok.toml" --set 'policy.options.compute="fp8"'
expect "fp8 misspelt" '[policy.options] compute: must be "fp8", got "fp9"' \
  -- train "$work/ok.toml" --set 'policy.options.compute="fp9"'
expect "policy option dtype" "--set policy.options.param_dtype=\"bf61\": [policy.options] param_dtype: must be a dtype (float32, bfloat16, float16, float64), got \"bf61\"" \
  -- train "$work/ok.toml" --set 'policy.options.param_dtype="bf61"'
printf 'local opt = options{recompute = {"boolean", default = false}}\nwrap(ctx.model, {activation_checkpoint = opt.recompute})\n' \
  >"$work/own_policy.lua"
expect "custom policy option" "[policy.options] recompte: the policy $work/own_policy.lua has no such option; did you mean 'recompute'?" \
  -- train "$work/ok.toml" --set "policy.name=\"$work/own_policy.lua\"" --set policy.options.recompte=true
# A policy's warnings are logged as it makes them: one that fails after a warning shows the
# warning that says why, before its error.
printf 'local layers = ctx.model:find{class = "LlamaDecoderLayr"}\nwrap(layers, {})\n' >"$work/typo_policy.lua"
"$FSDPP" plan "$work/ok.toml" --set "policy.name=\"$work/typo_policy.lua\"" >/dev/null 2>"$work/typo.err"
if ! grep -q "typo_policy.lua:1: the model has no class 'LlamaDecoderLayr'" "$work/typo.err" ||
   ! tail -1 "$work/typo.err" | grep -q "^fsdpp: error: policy error: .*typo_policy.lua:2: wrap"; then
  echo "FAIL a failing policy's warning: $(cat "$work/typo.err")"; failures=$((failures + 1))
fi
# --verbose adds the error's Lua traceback, its lines escaped as every log line is: the
# message a script raises cannot reach the terminal as its codes.
printf 'local function inner() error("red \\27[31m here") end\ninner()\n' >"$work/escape_policy.lua"
"$FSDPP" plan "$work/ok.toml" --verbose --set "policy.name=\"$work/escape_policy.lua\"" >/dev/null 2>"$work/escape.err"
if grep -q $'\x1b' "$work/escape.err" || ! grep -qF 'red \x1b[31m here' "$work/escape.err" ||
   ! grep -q "stack traceback" "$work/escape.err" || ! grep -q "escape_policy.lua:1: in .*inner" "$work/escape.err"; then
  echo "FAIL a traceback's escapes: $(cat -v "$work/escape.err")"; failures=$((failures + 1))
fi
expect "an unknown shipped policy" "--set policy.name=\"nosuch\": [policy] name: no shipped policy 'nosuch'" \
  -- train "$work/ok.toml" --set 'policy.name="nosuch"'
expect "an export dtype that is none" "export --dtype: dtype 'int8' is not one of" \
  -- export "$work/no-such-checkpoint" "$work/exported" --dtype int8
expect "missing adapter" "[model] adapter: $work/no-such-adapter: no such directory" \
  -- train "$work/ok.toml" --set "model.adapter=\"$work/no-such-adapter\""
# write_adapter DIR SHAPES: a rank-2 PEFT adapter of zeros on layer 0's attention, SHAPES a
# JSON map from "q_proj.lora_A" and the like to each factor's shape.
write_adapter() {
  mkdir -p "$1"
  python3 - "$1" "$2" <<'PY' || exit 1
import json, struct, sys
header, data = {}, b""
for factor, shape in json.loads(sys.argv[2]).items():
    size = 4 * shape[0] * shape[1]
    header[f"base_model.model.model.layers.0.self_attn.{factor}.weight"] = {
        "dtype": "F32", "shape": shape, "data_offsets": [len(data), len(data) + size]}
    data += b"\0" * size
blob = json.dumps(header).encode()
open(sys.argv[1] + "/adapter_model.safetensors", "wb").write(struct.pack("<Q", len(blob)) + blob + data)
json.dump({"peft_type": "LORA", "r": 2, "lora_alpha": 4}, open(sys.argv[1] + "/adapter_config.json", "w"))
PY
}
# For a q_proj 7 wide, where the fixture's is 48: made for another base.
write_adapter "$work/wide_adapter" '{"q_proj.lora_A": [2, 7], "q_proj.lora_B": [48, 2]}'
expect "adapter of another base" "wide_adapter/adapter_model.safetensors" \
  "q_proj.lora_A.weight' has shape [2, 7], the model's [2, 48]" \
  -- train "$work/ok.toml" --set "model.adapter=\"$work/wide_adapter\""
# A field of the wrong type in adapter_config.json names the file and the field.
cp -r "$work/wide_adapter" "$work/typed_adapter"
python3 -c 'import json, sys; json.dump({"peft_type": "LORA", "r": 2, "use_dora": "false"}, open(sys.argv[1], "w"))' \
  "$work/typed_adapter/adapter_config.json"
expect "adapter config field of another type" "typed_adapter/adapter_config.json: use_dora must be true or false, got \"false\"" \
  -- train "$work/ok.toml" --set "model.adapter=\"$work/typed_adapter\""
# Layer 0's q_proj and v_proj adapted; a policy naming q_proj alone would drop v_proj's and
# start layer 1's q_proj afresh, in training and in evaluation alike.
write_adapter "$work/qv_adapter" \
  '{"q_proj.lora_A": [2, 48], "q_proj.lora_B": [48, 2], "v_proj.lora_A": [2, 48], "v_proj.lora_B": [16, 2]}'
narrower=(--set "model.adapter=\"$work/qv_adapter\"" --set policy.options.lora_rank=2 --set policy.options.lora_alpha=4
          --set 'policy.options.lora_targets="q_proj"')
for command in train eval; do
  expect "$command with a policy's LoRA narrower than the adapter" "qv_adapter/adapter_config.json: adapters on 2 modules" \
    "the policy leaves out model.layers.0.self_attn.v_proj; it has none on model.layers.1.self_attn.q_proj" \
    -- $command "$work/ok.toml" "${narrower[@]}"
done

# The export at the end replaces its directory: refused at start where that would delete
# what no export wrote, the file or directory left as it was.
mkdir -p "$work/notes" && echo "mine" >"$work/notes/notes.txt"
expect "export_dir holding other files" "[checkpoint] export_dir: $work/notes: holds 'notes.txt', which an export does not write" \
  -- train "$work/ok.toml" --set "checkpoint.export_dir=\"$work/notes\""
echo "mine" >"$work/a-file"
expect "export_dir that is a file" "[checkpoint] export_dir: $work/a-file: is a file" \
  -- train "$work/ok.toml" --set "checkpoint.export_dir=\"$work/a-file\""
expect "export_dir over the out_dir" "[checkpoint] export_dir: $work holds [train] out_dir $work/out" \
  -- train "$work/ok.toml" --set "checkpoint.export_dir=\"$work\""
# A model of the user's where the run's export goes, in an out_dir no run recorded itself in,
# is not replaced either (in a run's own, an unmarked model is an export from before the mark).
mkdir -p "$work/own/model" && cp "$FIXTURES/llama_untied/config.json" "$FIXTURES/llama_untied/model.safetensors" "$work/own/model/"
expect "a model of one's own in out_dir/model" \
  "[checkpoint] export_dir (unset: in [train] out_dir): $work/own/model: holds a model that no export wrote" \
  -- train "$work/ok.toml" --set "train.out_dir=\"$work/own\""
cmp -s "$FIXTURES/llama_untied/model.safetensors" "$work/own/model/model.safetensors" ||
  { echo "FAIL a refused export changed the model in out_dir"; failures=$((failures + 1)); }
# Nor is what lies under the name the export works beside it under, found at start too.
mkdir -p "$work/staged/.partial-model" && echo "mine" >"$work/staged/.partial-model/notes.txt"
expect "a directory of one's own where the export stages" \
  "[checkpoint] export_dir: $work/staged/.partial-model: is in the way of the export to $work/staged/model" \
  -- train "$work/ok.toml" --set "checkpoint.export_dir=\"$work/staged/model\""
[ "$(cat "$work/notes/notes.txt" "$work/a-file")" = "$(printf 'mine\nmine')" ] ||
  { echo "FAIL a refused export_dir lost its files"; failures=$((failures + 1)); }

expect "a directory for eval --logits" "eval --logits $work: is a directory" -- eval "$work/ok.toml" --logits "$work"
# A file of documents (version 2: four documents of 500 tokens) is scored in packed rows, not
# the windows --logits writes.
python3 -c 'import struct, sys; t = [i % 101 for i in range(2000)]
open(sys.argv[1], "wb").write(b"FSDPTOK\0" + struct.pack("<IIQQQII", 2, 2, len(t), 101, 4, 0, 0) +
                              struct.pack(f"<{len(t)}H", *t) + struct.pack("<4Q", 500, 1000, 1500, 2000))' \
  "$work/documents.tok" || exit 1
expect "eval --logits over documents" "eval --logits $work/doc-logits.safetensors: writes windows of a token stream" \
  "documents.tok is evaluated in rows" -- eval "$work/ok.toml" --tokens "$work/documents.tok" --max-windows 4 \
  --logits "$work/doc-logits.safetensors"
# The run's outputs never write over its inputs or files of other kinds, and a checkpoint
# directory that cannot be made is found before the training it would save.
cp "$work/ok.tok" "$work/kept.tok"
expect "eval --logits over the token file" "eval --logits $work/kept.tok: exists and holds no earlier dump of logits" \
  -- eval "$work/ok.toml" --set "data.train=\"$work/kept.tok\"" --logits "$work/kept.tok"
expect "metrics over the token file" "[metrics] jsonl: $work/kept.tok: holds something other than a run's metrics" \
  -- train "$work/ok.toml" --set "data.train=\"$work/kept.tok\"" --set "metrics.jsonl=\"$work/kept.tok\""
cmp -s "$work/ok.tok" "$work/kept.tok" || { echo "FAIL a refused output changed the token file"; failures=$((failures + 1)); }
expect "metrics under a file" "[metrics] jsonl: $work/kept.tok/m.jsonl: cannot make its directory $work/kept.tok" \
  -- train "$work/ok.toml" --set "metrics.jsonl=\"$work/kept.tok/m.jsonl\""
expect "TensorBoard events under a file" "[metrics] tensorboard: $work/kept.tok/tb: cannot make it" \
  -- train "$work/ok.toml" --set "metrics.tensorboard=\"$work/kept.tok/tb\""
# Metrics that cannot be written end the run at the first record, naming the file.
if [ -w /dev/full ]; then
  expect "metrics to a full disk" "[metrics] jsonl: /dev/full: cannot write metrics: No space left on device" \
    -- train "$work/ok.toml" --set "train.out_dir=\"$work/full\"" --set 'metrics.jsonl="/dev/full"'
fi
# Left unset, the metrics file lies in out_dir, and the message names where out_dir was set.
mkdir -p "$work/held" && cp "$work/ok.tok" "$work/held/metrics.jsonl"
expect "metrics left unset, over a file in out_dir" \
  "--set train.out_dir=\"$work/held\": [metrics] jsonl (unset: in [train] out_dir): $work/held/metrics.jsonl: holds something other" \
  -- train "$work/ok.toml" --set "train.out_dir=\"$work/held\""
expect "a checkpoint dir under a file" "[checkpoint] dir: $work/a-file/checkpoints: cannot make it" \
  -- train "$work/ok.toml" --set "checkpoint.dir=\"$work/a-file/checkpoints\""
expect "adapter_dir over the out_dir" "[checkpoint] adapter_dir: $work/out holds [train] out_dir $work/out, which the adapter at the end would replace" \
  -- train "$work/ok.toml" --set policy.options.lora_rank=2 --set "checkpoint.adapter_dir=\"$work/out\""
expect "adapter_dir holding other files" "[checkpoint] adapter_dir: $work/notes: holds 'notes.txt', which an adapter does not write" \
  -- train "$work/ok.toml" --set "checkpoint.adapter_dir=\"$work/notes\""
expect "adapter_dir over another program's adapter" \
  "[checkpoint] adapter_dir: $work/qv_adapter: holds an adapter that no fsdpp run wrote (adapter_model.safetensors bears no run's mark)" \
  -- train "$work/ok.toml" --set policy.options.lora_rank=2 --set "checkpoint.adapter_dir=\"$work/qv_adapter\""
expect "a launch inside a launch" "launch: the ranks' command is a launch itself; give the command without a second launch" \
  -- launch --nproc-per-node 1 -- launch --nproc-per-node 1 -- train "$work/ok.toml"
FSDPP_LAUNCHER_PREFIXES_RANK=1 expect "a launch from a rank of a launch" "launch: this process is a rank of fsdpp launch already" \
  -- launch --nproc-per-node 1 -- train "$work/ok.toml"
SLURM_STEP_NUM_TASKS=4 expect "export as tasks of an srun step" "export: runs as one process, and this is one of a launch's (SLURM_STEP_NUM_TASKS 4)" \
  -- export "$work/no-such-checkpoint" "$work/exported"
expect "export as ranks of a launch" "export: runs as one process, and this is one of a launch's (WORLD_SIZE 2)" \
  -- launch --nproc-per-node 2 -- export "$work/no-such-checkpoint" "$work/exported"
expect "export of an empty CHECKPOINT" "export: needs CHECKPOINT and OUT, neither empty" -- export "" "$work/exported"
compgen -G "$work.tmp*" >/dev/null && { echo "FAIL eval --logits left $(compgen -G "$work.tmp*")"; failures=$((failures + 1)); }

expect "a shard size past the int range" "mesh: shard must be -1 or in [1, 2147483647], got 4294967298" \
  -- plan "$work/ok.toml" --world 2 --set policy.options.shard_size=4294967298

# A node whose master never comes: one line when the rendezvous times out, c10d's own log
# of the socket's time-out (forty lines with the exception's frames) held back.
port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
expect "a master that never comes" "rank 1: rendezvous at 127.0.0.1:$port failed: The client socket has timed out" \
  -- launch --nnodes 2 --node-rank 1 --nproc-per-node 1 --master-addr 127.0.0.1 --master-port "$port" \
  -- train "$work/ok.toml" --set parallel.timeout_s=2

expect "a NUL inside a path" "[train] out_dir: holds a control character (\\u0000)" \
  -- train "$work/ok.toml" --set 'train.out_dir="runs/a\u0000b"'
expect "a line break inside a path" "[train] out_dir: holds a control character (\\u000a)" \
  -- train "$work/ok.toml" --set 'train.out_dir="runs/a\nb"'

# A key of 50,000 dotted parts would overflow the parser's stack: refused first.
{ cat "$work/ok.toml"; python3 -c 'print("[" + ".".join(["a"] * 50000) + "]")'; } >"$work/deep_key.toml"
expect "a key of 50,000 dotted parts" "deep_key.toml:10: a key of 50000 dotted parts; at most 32" \
  -- train "$work/deep_key.toml"
# The parser frees a dotted key's tables by recursion too: a deep key anywhere a key stands
# is refused, its line named, where strings, comments and numbers hold dots of no key's.
deep=$(python3 -c 'print(".".join(["a"] * 150000))')
{ cat "$work/ok.toml"; echo '[policy.options]'; echo "x = {$deep = 1}"; } >"$work/deep_inline.toml"
expect "a deep key inside an inline table" "deep_inline.toml:11: a key of 150000 dotted parts; at most 32" \
  -- train "$work/deep_inline.toml"
{ cat "$work/ok.toml"; echo "[\"!\".$deep]"; } >"$work/deep_quoted.toml"
expect "a deep key after a quoted part" "deep_quoted.toml:10: a key of 150001 dotted parts" -- train "$work/deep_quoted.toml"
{ cat "$work/ok.toml"; echo "[[a . ${deep//./ . }]]"; } >"$work/deep_array_table.toml"
expect "a deep [[header]] with spaces" "deep_array_table.toml:10: a key of 150001 dotted parts" \
  -- train "$work/deep_array_table.toml"
expect "a deep key in a --set table" "a key of 20000 dotted parts; at most 32" \
  -- train "$work/ok.toml" --set "policy.options.x={${deep:0:39999} = 1}"
dots=$(python3 -c 'print("." * 40)')
{ cat "$work/ok.toml"; echo "# $dots"; echo "[policy.options]"; echo "x = \"$dots\""; echo "y = '''$dots'''"
  echo "z = 1.5"; } >"$work/dots_no_key.toml"
expect "dots in strings, comments and numbers are no key's" "dots_no_key.toml:12: [policy.options] x: the policy" \
  -- train "$work/dots_no_key.toml"
expect "a control character in a policy option" "[policy] options.lora_targets: holds a control character (\\u001b)" \
  -- train "$work/ok.toml" --set 'policy.options.lora_targets="q_proj\u001b[31m"'
expect "launch without --nproc-per-node" "launch: --nproc-per-node N is required (the ranks to start on this node)" \
  -- launch -- train "$work/ok.toml"
# The ranks' command line is checked before any rank starts: one line, not one per rank.
expect "a launch of a program other than fsdpp's commands" \
  "launch: unknown command 'python3' (commands: train, eval, plan, launch, export, probe; see fsdpp --help); a launch's ranks run fsdpp's own commands" \
  -- launch --nproc-per-node 2 -- python3 x.py
expect "a launch of a mistyped option" "launch: train: unknown option --stpes (see fsdpp train --help)" \
  -- launch --nproc-per-node 2 -- train "$work/ok.toml" --stpes 3
expect "a node of two without node 0's address" \
  "launch: --nnodes 2 needs --node-rank (this node's place, 0 to 1) and --master-addr (node 0's address) on every node" \
  -- launch --nproc-per-node 1 --nnodes 2 --node-rank 1 -- train "$work/ok.toml"
expect "a directory that is no dataset as the data" \
  "$work: a directory without samples.jsonl; [data] train names a token file" \
  -- train "$work/ok.toml" --set "data.train=\"$work\"" --set 'data.train_on="completion"'
expect "resume = \"lastest\"" "[checkpoint] resume: lastest: no such file or directory" 'did you mean "latest"?' \
  -- train "$work/ok.toml" --set 'checkpoint.resume="lastest"'
ln -sfn loop "$work/loop"
expect "an out_dir that is a loop of links" "[train] out_dir: $work/loop: Too many levels of symbolic links" \
  -- train "$work/ok.toml" --set "train.out_dir=\"$work/loop\""
expect "a directory as the policy" "--set policy.name=$work: [policy] name: $work is not a file" \
  -- train "$work/ok.toml" --set "policy.name=$work"
{ cat "$work/ok.toml"; echo "[policy.options]"; echo '"lora.rank" = 1'; } >"$work/quoted_option.toml"
expect "an option key holding a dot, named at its own line" \
  "quoted_option.toml:11: [policy.options] lora.rank: the policy policies/llama.lua has no such option" \
  -- train "$work/quoted_option.toml"
expect "a number with a space before it" "plan: --world takes a whole number in [1, 1048576], got ' 4'" \
  -- plan "$work/ok.toml" --world " 4"
# An option given twice, empty or spaced from its '=' is refused as such, not read as another.
expect "an option given twice" "plan: --world given twice" -- plan "$work/ok.toml" --world 3 --world 5
expect "an option given twice, once with '='" "eval: --max-windows given twice" \
  -- eval "$work/ok.toml" --max-windows 2 --max-windows=3
expect "an empty number" "plan: --world takes a whole number in [1, 1048576], got ''" -- plan "$work/ok.toml" --world ""
expect "an empty count" "eval: --max-windows takes a whole number in [0, 1099511627776], got ''" \
  -- eval "$work/ok.toml" --max-windows ""
expect "an empty file name" "eval: --tokens needs a value, got ''" -- eval "$work/ok.toml" --tokens ""
expect "a space after '='" "plan: --world= has no value after '='" -- plan "$work/ok.toml" --world= 3
expect "a launch option given twice" "launch: --nproc-per-node given twice" \
  -- launch --nproc-per-node 2 --nproc-per-node 3 -- train "$work/ok.toml"
# A plan refused for sizes the run file's [policy.options] gave names them.
expect "a mesh from the run file's options" \
  "mesh replicate 1 × shard 5 ≠ world 4; [policy.options] given: shard_size = 5 (--set policy.options.shard_size=5)" \
  -- plan "$work/ok.toml" --world 4 --set policy.options.shard_size=5
# A flag said twice is said once.
"$FSDPP" plan "$work/ok.toml" --json --json >/dev/null 2>"$work/flags.err" ||
  { echo "FAIL a flag given twice: $(tail -1 "$work/flags.err")"; failures=$((failures + 1)); }
FSDPP_POLICY_DIR=$work/none expect "FSDPP_POLICY_DIR naming no directory" \
  "[policy] name: no shipped policy 'llama': the policy directory $work/none (FSDPP_POLICY_DIR) is no directory" \
  -- train "$work/ok.toml"
expect "an unclosed quote in --set" "--set train.out_dir=\"abc: invalid TOML value" \
  -- train "$work/ok.toml" --set 'train.out_dir="abc'

# float16 gradients no scale keeps finite (a fresh model of huge weights): the scale backs off
# to its floor, [loss_scale] min_scale, and the next overflow there stops the run, where it
# would otherwise back off to 0 and skip every step after.
mkdir -p "$work/overflows"
python3 -c 'import json, sys; c = json.load(open(sys.argv[1])); c["initializer_range"] = 10.0
json.dump(c, open(sys.argv[2], "w"))' "$FIXTURES/llama_untied/config.json" "$work/overflows/config.json"
"$FSDPP" train "$work/ok.toml" --set "model.path=\"$work/overflows\"" --set 'policy.options.param_dtype="float16"' \
  --set loss_scale.backoff_factor=1e-6 --set train.steps=5 --set "train.out_dir=\"$work/overflows/out\"" \
  >"$work/overflows.log" 2>&1
rc=$?
[ $rc -eq 2 ] && tail -1 "$work/overflows.log" | grep -qF "fsdpp: error: loss scale: a step's gradients are not finite at [loss_scale] min_scale = 1, the lowest the scale backs off to (from init_scale 65536)" ||
  { echo "FAIL float16 gradients that overflow at the scale's floor (exit $rc): $(tail -1 "$work/overflows.log")"
    failures=$((failures + 1)); }

mkfifo "$work/fifo.toml"
expect "FIFO as the run file" "fifo.toml: not a regular file" -- train "$work/fifo.toml"

head -c 20 "$work/ok.tok" >"$work/short_header.tok"
expect "a token file cut inside its header" "short_header.tok: the header is cut short (20 bytes of its" \
  -- train "$work/ok.toml" --set "data.train=\"$work/short_header.tok\""

# Weights of NaN train nothing (every update skipped): refused as they load, naming the tensor.
mkdir -p "$work/nan_weights"
cp "$FIXTURES/llama_untied/config.json" "$work/nan_weights/"
"$PYTHON" -c 'import sys, torch; from safetensors.torch import load_file, save_file
w = load_file(sys.argv[1]); w["model.norm.weight"] = torch.full_like(w["model.norm.weight"], float("nan"))
save_file(w, sys.argv[2])' "$FIXTURES/llama_untied/model.safetensors" "$work/nan_weights/model.safetensors" || exit 1
expect "weights of NaN" "[model] path $work/nan_weights: parameter 'model.norm.weight' holds NaN or inf" \
  -- train "$work/ok.toml" --set "model.path=\"$work/nan_weights\""
expect "weights of NaN, in eval" "[model] path $work/nan_weights: parameter 'model.norm.weight' holds NaN or inf" \
  -- eval "$work/ok.toml" --set "model.path=\"$work/nan_weights\""

# A weight past float16's range is refused at the export rather than written as inf.
mkdir -p "$work/big_weights"
cp "$FIXTURES/llama_untied/config.json" "$work/big_weights/"
"$PYTHON" -c 'import sys, torch; from safetensors.torch import load_file, save_file
w = load_file(sys.argv[1]); w["model.norm.weight"] = torch.full_like(w["model.norm.weight"], 1e6)
save_file(w, sys.argv[2])' "$FIXTURES/llama_untied/model.safetensors" "$work/big_weights/model.safetensors" || exit 1
expect "an export to float16 of a weight past its range" "export: tensor 'model.norm.weight' holds values as large as" \
  "past float16's range" "(the last step's checkpoint is saved" -- train "$work/ok.toml" --set "model.path=\"$work/big_weights\"" \
  --set optimizer.lr=1e-12 --set 'checkpoint.export_dtype="float16"' --set "train.out_dir=\"$work/big_out\""

# An export directory the run cannot write is refused before the training it would end with.
expect "an export_dir that cannot be made" "[checkpoint] export_dir: /proc/fsdpp-export: cannot write beside it" \
  -- train "$work/ok.toml" --set 'checkpoint.export_dir="/proc/fsdpp-export"' --set "train.out_dir=\"$work/proc_out\""

# A resume whose [train] steps ends before its checkpoint's step has nothing to train.
"$FSDPP" train "$work/ok.toml" --set train.steps=2 --set checkpoint.save_every=2 \
  --set "train.out_dir=\"$work/ended\"" >"$work/ended.log" 2>&1 || { echo "FAIL a run of 2 steps: $(tail -1 "$work/ended.log")"; failures=$((failures + 1)); }
expect "a resume past its [train] steps" "[train] steps = 1 ends before step 2, where the checkpoint it resumes stands" \
  -- train "$work/ok.toml" --set train.steps=1 --set 'checkpoint.resume="latest"' --set "train.out_dir=\"$work/ended\""

# Beside other runs (reuse_out_dir), a second run of the same settings is refused while the
# first trains: it would share its checkpoints and metrics.
shared=(--set train.reuse_out_dir=true --set train.steps=100000 --set "train.out_dir=\"$work/shared\"")
"$FSDPP" train "$work/ok.toml" "${shared[@]}" >"$work/shared-first.log" 2>&1 &
first=$!
for _ in $(seq 300); do compgen -G "$work/shared/.lock-*" >/dev/null && grep -q " info step " "$work/shared-first.log" && break; sleep 0.2; done
expect "a second run of one's settings beside it" "another run of these settings is training in this [train] out_dir" \
  -- train "$work/ok.toml" "${shared[@]}"
kill "$first" 2>/dev/null; wait "$first" 2>/dev/null

if [ $failures -ne 0 ]; then
  echo "$failures bad-input case(s) failed"
  exit 1
fi
echo "all bad-input cases exit 2 with one clear line"
