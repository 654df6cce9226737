-- Wrap policy for DeepSeek-V3 models: each DeepseekV3DecoderLayer a unit (its routed experts in
-- it, or a unit of their own with experts = "unit"; the shared experts and the router stay
-- with the layer), the embedding (with lm_head when tied) and lm_head units, the rest in the
-- root. Options: see policies/lib/fsdp.lua.
local fsdp = require("fsdp")
fsdp.standard{classes = {"DeepseekV3DecoderLayer"}}
