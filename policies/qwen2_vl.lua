-- Wrap policy for Qwen2-VL models: each Qwen2VLDecoderLayer a unit, each Qwen2VLVisionBlock a unit
-- (vision_tower = "shard"), in the root ("root") or the whole tower one replicated unit
-- ("replicate"); the embedding (with lm_head when tied) and lm_head units, the rest in the
-- root. Options: see policies/lib/fsdp.lua.
local fsdp = require("fsdp")
fsdp.standard{classes = {"Qwen2VLDecoderLayer"}, vision = {"Qwen2VLVisionBlock"}}
