-- Helpers shared by the shipped policies: unit options from [policy.options], and the
-- standard rule (decoder layers, vision blocks, embeddings, lm_head, then the root).
--
-- [policy.options] keys the helpers read:
--   shard_size            ranks per shard group: -1 (all, default), "auto", or a number
--   replicate             mesh rows (HSDP); default world / shard_size
--   reshard_after_forward layers free gathered params after forward (default true); an
--                         integer k keeps 1/k so backward gathers over k ranks
--   activation_checkpoint layers recompute forward in backward (default false)
--   offload               "cpu" or "none"
--   param_dtype           gather and compute dtype (default: the model's [model] dtype);
--                         master shards stay float32 (float64 for a float64 model)
--   reduce_dtype          gradient reduction dtype (default: the master shards')
--   vision_tower          "shard": each vision block its own unit (default); "root": the
--                         vision blocks stay in the root unit; "replicate": the whole tower
--                         one unit, unsharded on every rank, its gradients all-reduced
--   mixed_mm_data         true is vision_tower = "root" (the name the option had before)
--   fused_linear_logprob  lm_head stays in the root unit (used outside its forward)
--   experts               "layer": a MoE layer's routed experts stay in its layer's unit
--                         (default); "unit": each layer's routed experts (ctx.expert_modules)
--                         a unit of their own, with experts_reshard_after_forward,
--                         experts_offload, experts_param_dtype and experts_reduce_dtype
--                         (each defaults to the layers' option)
--   lora_rank             LoRA adapters of this rank (none when unset), on lora_targets:
--                         comma-separated module names ("q_proj,v_proj": every module whose
--                         path ends so) or classes (default "q_proj,k_proj,v_proj,o_proj");
--                         lora_alpha (default 8), lora_dropout (default 0), lora_trainable:
--                         comma-separated names of base modules that keep training
--                         ("lm_head,norm"); the rest of the base is frozen
local M = {}

local function option(name, default)
  local value = ctx.options[name]
  if value == nil then return default end
  return value
end

-- Options shared by every unit of a plan (the engine needs one mesh for all of them).
function M.unit_options(extra)
  local opts = {
    mesh = mesh{shard = option("shard_size", -1), replicate = option("replicate", nil)},
    offload = offload(option("offload", "none")),
    precision = precision{param = option("param_dtype", nil), reduce = option("reduce_dtype", nil)},
  }
  for key, value in pairs(extra or {}) do opts[key] = value end
  return opts
end

function M.layer_options()
  return M.unit_options{
    reshard_after_forward = option("reshard_after_forward", true),
    activation_checkpoint = option("activation_checkpoint", false),
  }
end

-- A unit of one layer's routed experts: the layers' options unless experts_* says otherwise.
function M.expert_options()
  return {
    mesh = mesh{shard = option("shard_size", -1), replicate = option("replicate", nil)},
    offload = offload(option("experts_offload", option("offload", "none"))),
    precision = precision{param = option("experts_param_dtype", option("param_dtype", nil)),
                          reduce = option("experts_reduce_dtype", option("reduce_dtype", nil))},
    reshard_after_forward = option("experts_reshard_after_forward", option("reshard_after_forward", true)),
  }
end

-- The root keeps its leftovers gathered: they are used last in forward and first in backward.
function M.root_options()
  return M.unit_options{reshard_after_forward = false}
end

local function contains(list, value)
  for _, v in ipairs(list) do
    if v == value then return true end
  end
  return false
end

-- Wraps every module of the listed classes, each its own unit; returns how many.
function M.wrap_classes(classes, opts)
  local count = 0
  for _, class in ipairs(classes) do
    for _, module in ipairs(ctx.model:find{class = class}) do
      wrap(module, opts)
      count = count + 1
    end
  end
  return count
end

-- The embedding and lm_head: one unit when their weights are tied (they must share one),
-- else a unit each; lm_head stays in the root with fused_linear_logprob.
function M.wrap_embedding_and_head(opts)
  local fused = option("fused_linear_logprob", false)
  local embeddings = ctx.model:find{class = "Embedding"}
  local heads = ctx.model:find{path = "^lm_head$"}
  if ctx.config.tie_word_embeddings then
    if not fused and #embeddings > 0 and #heads > 0 then wrap({embeddings[1], heads[1]}, opts) end
    return
  end
  for _, e in ipairs(embeddings) do wrap(e, opts) end
  if not fused then
    for _, h in ipairs(heads) do wrap(h, opts) end
  end
end

-- Where routed experts go: [policy.options] experts.
local function expert_placement()
  local placement = option("experts", "layer")
  if placement ~= "layer" and placement ~= "unit" then
    error("experts must be \"layer\" or \"unit\", not " .. tostring(placement), 3)  -- the policy's line
  end
  return placement
end

-- The modules `names` (comma-separated module names or classes) select; each name that
-- selects nothing is reported with the Linear module names the model has.
local function modules_named(names, what)
  local found, available = {}, {}
  for name in string.gmatch(names, "[^,%s]+") do
    local hits = ctx.model:find{where = function(m)
      return m:class_name() == name or m:path() == name or string.sub(m:path(), -#name - 1) == "." .. name
    end}
    if #hits == 0 then
      if next(available) == nil then
        for _, m in ipairs(ctx.model:find{class = "Linear"}) do available[string.match(m:path(), "[^.]+$")] = true end
      end
      local listed = {}
      for n in pairs(available) do listed[#listed + 1] = n end
      table.sort(listed)
      warn(what .. ": '" .. name .. "' matches no module (Linear modules: " .. table.concat(listed, ", ") .. ")")
    end
    for _, m in ipairs(hits) do found[#found + 1] = m end
  end
  return found
end

-- LoRA as [policy.options] lora_* ask.
function M.lora_from_options()
  local rank = option("lora_rank", nil)
  if rank == nil then return end
  if math.type(rank) ~= "integer" or rank < 1 then
    error("lora_rank must be a whole number of at least 1, not " .. tostring(rank), 3)  -- the policy's line
  end
  lora{targets = modules_named(option("lora_targets", "q_proj,k_proj,v_proj,o_proj"), "lora_targets"),
       rank = rank, alpha = option("lora_alpha", 8), dropout = option("lora_dropout", 0),
       trainable = modules_named(option("lora_trainable", ""), "lora_trainable")}
end

-- How the vision tower is wrapped: [policy.options] vision_tower, else mixed_mm_data.
local function vision_tower_mode()
  local mode = option("vision_tower", option("mixed_mm_data", false) and "root" or "shard")
  if mode ~= "shard" and mode ~= "root" and mode ~= "replicate" then
    error("vision_tower must be \"shard\", \"root\" or \"replicate\", not " .. tostring(mode), 3)  -- the policy's line
  end
  return mode
end

-- The standard rule: no_split_modules plus `classes` as units, routed experts as experts
-- says, the vision tower as vision_tower says (`vision` names its block classes), then
-- embeddings and lm_head, then the root.
function M.standard(spec)
  local classes = {}
  local vision = spec.vision or {}
  local mode = vision_tower_mode()
  local placement = expert_placement()
  local function add(class)
    if contains(classes, class) then return end
    if contains(vision, class) and mode ~= "shard" then return end
    classes[#classes + 1] = class
  end
  for _, class in ipairs(ctx.no_split_modules) do add(class) end
  for _, class in ipairs(spec.classes or {}) do add(class) end
  for _, class in ipairs(vision) do add(class) end
  if M.wrap_classes(classes, M.layer_options()) == 0 then
    error("no module of the classes " .. table.concat(classes, ", ") .. " exists in this model", 2)
  end
  if placement == "unit" then
    if M.wrap_classes(ctx.expert_modules, M.expert_options()) == 0 then
      warn("experts = \"unit\": this model has no routed experts")
    end
  end
  if mode == "replicate" and #vision > 0 then
    for _, tower in ipairs(ctx.model:find{path = "^visual$"}) do
      wrap(tower, M.unit_options{mesh = mesh{shard = 1, replicate = ctx.world_size}, reshard_after_forward = false})
    end
  end
  M.wrap_embedding_and_head(M.unit_options())
  wrap(ctx.model, M.root_options())
  M.lora_from_options()
end

return M
