-- Wrap policy for Llama models: each LlamaDecoderLayer a unit, the embedding (with lm_head when tied) and lm_head
-- units, the rest in the root. Options: see policies/lib/fsdp.lua.
local fsdp = require("fsdp")
fsdp.standard{classes = {"LlamaDecoderLayer"}}
