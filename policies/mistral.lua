-- Wrap policy for Mistral models: each MistralDecoderLayer a unit, the embedding (with lm_head when tied) and
-- lm_head units, the rest in the root. Options: see policies/lib/fsdp.lua.
local fsdp = require("fsdp")
fsdp.standard{classes = {"MistralDecoderLayer"}}
