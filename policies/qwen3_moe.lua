-- Wrap policy for Qwen3-MoE models: each Qwen3MoeDecoderLayer a unit (its routed experts in
-- it, or a unit of their own with experts = "unit"), the embedding (with lm_head when tied)
-- and lm_head units, the rest in the root. Options: see policies/lib/fsdp.lua.
local fsdp = require("fsdp")
fsdp.standard{classes = {"Qwen3MoeDecoderLayer"}}
