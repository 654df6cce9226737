-- Every parameter in a unit of the policy's own: each decoder layer, the decoder body around
-- them (the embedding and the final norm) and lm_head. The root is left with none, so the
-- plan leaves it out, as fully_shard on a module without parameters does nothing.
for _, layer in ipairs(ctx.model:find{class = "LlamaDecoderLayer"}) do wrap(layer) end
wrap(ctx.model:get("model"))
wrap(ctx.model:get("lm_head"))
wrap(ctx.model)
