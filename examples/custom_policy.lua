-- A wrap policy written from scratch, no helpers: pairs of decoder layers share a unit
-- (fewer, larger all-gathers), the last layer stays gathered between forward and backward,
-- and [policy.options] recompute = true checkpoints every pair. Its one option is declared,
-- so a misspelt key in the run file is an error there, not silently ignored.
local opt = options{recompute = {"boolean", default = false, doc = "each pair of layers recomputes its forward in backward"}}
local model = ctx.model
local layers = model:find{class = ctx.no_split_modules[1]}
log(#layers .. " layers of " .. ctx.no_split_modules[1] .. " on " .. ctx.world_size .. " ranks")

local everyone = mesh{shard = -1}
for i = 1, #layers, 2 do
  local group = {layers[i], layers[i + 1]}  -- the second is nil for an odd last layer
  wrap(group, {
    mesh = everyone,
    reshard_after_forward = i + 1 < #layers,
    activation_checkpoint = opt.recompute,
  })
end

-- Tied embeddings must share a unit with lm_head; untied, each gets its own.
local embed, head = model:get("model.embed_tokens"), model:get("lm_head")
if ctx.config.tie_word_embeddings then
  wrap({embed, head}, {mesh = everyone})
else
  wrap(embed, {mesh = everyone})
  wrap(head, {mesh = everyone})
end
wrap(model, {mesh = everyone, reshard_after_forward = false})
