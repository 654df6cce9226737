-- Helpers shared by the shipped policies: unit options from [policy.options], and the
-- standard rule (decoder layers, vision blocks, embeddings, lm_head, then the root). Each
-- helper declares the options it reads (options{...}); `fsdpp plan` lists them with their
-- values, and a [policy.options] key no helper declared is an error.
local M = {}

-- The value, or `fallback` when it is nil (false is a value).
local function either(value, fallback)
  if value == nil then return fallback end
  return value
end

-- What every unit reads: declared whenever a policy loads this library.
local unit = options{
  shard_size = {-1, "integer", "auto", min = 1, default = -1,
                doc = "ranks per shard group: -1 all of them, \"auto\" by model size when not training"},
  replicate = {"integer", min = 1, doc = "mesh rows (HSDP); unset: the world over shard_size"},
  reshard_after_forward = {"boolean", "integer", min = 1, default = true,
                           doc = "layers free gathered params after forward; k keeps 1/k, so backward gathers over k ranks"},
  activation_checkpoint = {"boolean", default = false, doc = "layers recompute their forward in backward"},
  offload = {"cpu", "none", default = "none", doc = "where master shards live between uses"},
  param_dtype = {"dtype", doc = "gather and compute dtype; unset: the [model] dtype (masters stay float32)"},
  reduce_dtype = {"dtype", doc = "gradient reduction dtype; unset: the masters'"},
  compute = {"fp8", doc = "layers' linear products in float8 (GPUs of compute capability 9.0+, "
                          .. "param_dtype = \"bfloat16\"); unset: in param_dtype"},
}

-- Options shared by every unit of a plan (the engine needs one mesh for all of them).
function M.unit_options(extra)
  local opts = {
    mesh = mesh{shard = unit.shard_size, replicate = unit.replicate},
    offload = offload(unit.offload),
    precision = precision{param = unit.param_dtype, reduce = unit.reduce_dtype},
  }
  for key, value in pairs(extra or {}) do opts[key] = value end
  return opts
end

function M.layer_options()
  return M.unit_options{
    reshard_after_forward = unit.reshard_after_forward,
    activation_checkpoint = unit.activation_checkpoint,
    precision = precision{param = unit.param_dtype, reduce = unit.reduce_dtype, compute = unit.compute},
  }
end

-- Where routed experts go, and the options of their own units.
local function expert_settings()
  return options{
    experts = {"layer", "unit", default = "layer",
               doc = "\"layer\": routed experts stay in their layer's unit; \"unit\": a unit of their own"},
    experts_reshard_after_forward = {"boolean", "integer", min = 1,
                                     doc = "experts = \"unit\": as reshard_after_forward; unset: the layers'"},
    experts_offload = {"cpu", "none", doc = "experts = \"unit\": as offload; unset: the layers'"},
    experts_param_dtype = {"dtype", doc = "experts = \"unit\": as param_dtype; unset: the layers'"},
    experts_reduce_dtype = {"dtype", doc = "experts = \"unit\": as reduce_dtype; unset: the layers'"},
  }
end

-- A unit of one layer's routed experts: the layers' options unless experts_* says otherwise.
function M.expert_options()
  local e = expert_settings()
  return {
    mesh = mesh{shard = unit.shard_size, replicate = unit.replicate},
    offload = offload(either(e.experts_offload, unit.offload)),
    precision = precision{param = either(e.experts_param_dtype, unit.param_dtype),
                          reduce = either(e.experts_reduce_dtype, unit.reduce_dtype)},
    reshard_after_forward = either(e.experts_reshard_after_forward, unit.reshard_after_forward),
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
  local fused = options{
    fused_linear_logprob = {"boolean", default = false, doc = "lm_head stays in the root unit (used outside its forward)"},
  }.fused_linear_logprob
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

-- The modules `names` (comma-separated module names or classes) select; each name that
-- selects nothing is reported with the names it could take: of the Linear modules where
-- `linear_only`, else of every module holding parameters but a list's numbered entries.
-- A name that matches nothing is warned of, or with `required` an error: a module misspelt in
-- freeze would otherwise train what it was to hold.
local function modules_named(names, what, linear_only, required)
  local found, available = {}, {}
  for name in string.gmatch(names, "[^,%s]+") do
    local hits = ctx.model:find{where = function(m)
      return m:class_name() == name or m:path() == name or string.sub(m:path(), -#name - 1) == "." .. name
    end}
    if #hits == 0 then
      if next(available) == nil then
        local candidates = linear_only and ctx.model:find{class = "Linear"}
            or ctx.model:find{where = function(m) return m:path() ~= "" and m:param_count() > 0 end}
        for _, m in ipairs(candidates) do
          local last = string.match(m:path(), "[^.]+$")
          if not string.match(last, "^%d+$") then available[last] = true end
        end
      end
      local listed = {}
      for n in pairs(available) do listed[#listed + 1] = n end
      table.sort(listed)
      local message = what .. ": '" .. name .. "' matches no module (" ..
                      (linear_only and "Linear modules" or "modules") .. ": " .. table.concat(listed, ", ") .. ")"
      if required then error(message, 0) end
      warn(message)
    end
    for _, m in ipairs(hits) do found[#found + 1] = m end
  end
  return found
end

-- LoRA as [policy.options] lora_* ask.
function M.lora_from_options()
  local opt = options{
    lora_rank = {"integer", min = 1, max = 65536, doc = "LoRA adapters of this rank on lora_targets; unset: none"},
    lora_targets = {"string", doc = "comma-separated module names (every module whose path ends so) or classes; " ..
                                    "unset: q_proj,k_proj,v_proj,o_proj"},
    lora_alpha = {"number", min = 1e-6, max = 1e6, doc = "the adapters' scale is alpha / rank; unset: 8"},
    lora_dropout = {"number", min = 0, max = 0.99, doc = "dropout on the adapters' input; unset: 0"},
    lora_trainable = {"string",
                      doc = "comma-separated base modules that keep training (\"model.norm\", and lm_head where " ..
                            "untied; a classifier's score always does); the rest is frozen"},
  }
  if opt.lora_rank == nil then
    -- Without a rank no adapter is made and the whole model trains: a LoRA option given alone
    -- is a LoRA run the user meant, not a full fine-tune.
    for _, name in ipairs{"lora_targets", "lora_alpha", "lora_dropout", "lora_trainable"} do
      if opt[name] ~= nil then
        error(name .. " is given without lora_rank, so no adapter would be made and the whole model would " ..
              "train; set lora_rank for LoRA, or leave out the lora_ options", 0)
      end
    end
    return
  end
  -- A name the run file gives that matches nothing is an error, as freeze's is: the adapters
  -- or the training it asked for would be left out. The default targets may miss a model's
  -- attention (latent attention has no k_proj): a warning.
  local targets = modules_named(either(opt.lora_targets, "q_proj,k_proj,v_proj,o_proj"), "lora_targets", true,
                                opt.lora_targets ~= nil)
  local trainable = modules_named(either(opt.lora_trainable, ""), "lora_trainable", false, true)
  -- A sequence-classification model's score head trains beside the adapters, as peft's
  -- SEQ_CLS task keeps it (modules_to_save): frozen, a head drawn afresh would stay random.
  for _, score in ipairs(ctx.model:find{path = "^score$"}) do
    local listed = false
    for _, m in ipairs(trainable) do listed = listed or m:path() == "score" end
    if not listed then trainable[#trainable + 1] = score end
  end
  lora{targets = targets, rank = opt.lora_rank, alpha = either(opt.lora_alpha, 8),
       dropout = either(opt.lora_dropout, 0), trainable = trainable}
end

-- The modules [policy.options] freeze names (a vision tower held as loaded) train no more.
function M.freeze_from_options()
  local names = options{
    freeze = {"string", default = "",
              doc = "comma-separated modules (names or classes, \"visual\" for a vision tower) whose " ..
                    "parameters do not train; refused with LoRA, whose lora_trainable says what of the base trains"},
  }.freeze
  if names == "" then return end
  freeze(modules_named(names, "freeze", false, true))
end

-- How the vision tower is wrapped: [policy.options] vision_tower, else mixed_mm_data; said
-- where either is given to no purpose (a model of no `vision` blocks, or vision_tower over
-- mixed_mm_data).
local function vision_tower_mode(vision)
  local opt = options{
    vision_tower = {"shard", "root", "replicate",
                    doc = "\"shard\": each vision block a unit; \"root\": the blocks stay in the root; " ..
                          "\"replicate\": the tower one unsharded unit; unset: \"root\" with mixed_mm_data, else \"shard\""},
    mixed_mm_data = {"boolean", default = false, doc = "true is vision_tower = \"root\""},
  }
  if #vision == 0 and (opt.vision_tower ~= nil or opt.mixed_mm_data) then
    warn((opt.vision_tower ~= nil and "vision_tower" or "mixed_mm_data") .. ": this model has no vision tower")
  elseif opt.mixed_mm_data and opt.vision_tower ~= nil and opt.vision_tower ~= "root" then
    warn("mixed_mm_data = true asks vision_tower = \"root\"; vision_tower = \"" .. opt.vision_tower .. "\" overrides it")
  end
  return either(opt.vision_tower, opt.mixed_mm_data and "root" or "shard")
end

-- Warns of each experts_* option given where experts = "layer" leaves it nothing to apply to.
local function warn_unused_expert_options(e)
  if e.experts == "unit" then return end
  for _, name in ipairs{"experts_reshard_after_forward", "experts_offload", "experts_param_dtype",
                        "experts_reduce_dtype"} do
    if e[name] ~= nil then warn(name .. ": applies with experts = \"unit\" alone, and experts is \"layer\"") end
  end
end

-- The standard rule: no_split_modules plus `classes` as units, routed experts as experts
-- says, the vision tower as vision_tower says (`vision` names its block classes), then
-- embeddings and lm_head, then the root.
function M.standard(spec)
  local classes = {}
  local vision = spec.vision or {}
  local mode = vision_tower_mode(vision)
  local experts = expert_settings()
  warn_unused_expert_options(experts)
  local placement = experts.experts
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
  -- What transformers keeps in float32 whatever the model's dtype (DeepSeek-V3's router)
  -- gathers in float32 under a lower param_dtype: a unit of its own inside its layer's.
  local below_float32 = {bfloat16 = true, bf16 = true, float16 = true, fp16 = true}
  if below_float32[unit.param_dtype] then
    M.wrap_classes(ctx.float32_modules, M.unit_options{
      precision = precision{param = "float32", reduce = unit.reduce_dtype},
    })
  end
  if mode == "replicate" and #vision > 0 then
    for _, tower in ipairs(ctx.model:find{path = "^visual$"}) do
      wrap(tower, M.unit_options{mesh = mesh{shard = 1, replicate = ctx.world_size}, reshard_after_forward = false})
    end
  end
  M.wrap_embedding_and_head(M.unit_options())
  wrap(ctx.model, M.root_options())
  M.lora_from_options()
  M.freeze_from_options()
end

return M
