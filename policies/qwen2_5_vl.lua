-- Wrap policy for Qwen2.5-VL models: each Qwen2_5_VLDecoderLayer a unit, each Qwen2_5_VLVisionBlock a unit
-- (vision_tower = "shard"), in the root ("root") or the whole tower one replicated unit
-- ("replicate"); the embedding (with lm_head when tied) and lm_head units, the rest in the
-- root. Options: see policies/lib/fsdp.lua.
local fsdp = require("fsdp")
fsdp.standard{classes = {"Qwen2_5_VLDecoderLayer"}, vision = {"Qwen2_5_VLVisionBlock"}}
