-- Units on different meshes: decoder layers sharded over every rank, the embedding
-- replicated whole on every rank (shard 1), the root sharded in pairs when the world is even.
local all = mesh{shard = -1}
for _, layer in ipairs(ctx.model:find{class = "LlamaDecoderLayer"}) do wrap(layer, {mesh = all}) end
wrap(ctx.model:get("model.embed_tokens"), {mesh = mesh{shard = 1}})
wrap(ctx.model, {mesh = ctx.world_size % 2 == 0 and mesh{shard = 2} or all, reshard_after_forward = false})
