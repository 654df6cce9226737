-- Wrap policy by size: walking the tree bottom-up, every module whose parameters not yet in
-- a unit number at least [policy.options] min_num_params (default 100000000) becomes a unit,
-- containers (ModuleList) aside, whose parameters pass up to their owner; the root takes the
-- rest. An embedding tied to lm_head cannot be a unit alone (the engine
-- refuses the split); use transformer_auto for tied models.
local fsdp = require("fsdp")
local min_num_params = options{
  min_num_params = {"integer", min = 1, default = 100000000, doc = "parameters a module must hold, not yet in a unit, to become one"},
}.min_num_params
local opts = fsdp.layer_options()

local containers = {}
for _, class in ipairs(ctx.container_modules) do containers[class] = true end

-- Returns the parameters of `module`'s subtree that no unit below it has taken.
local function visit(module)
  local left = module:own_param_count()
  for _, child in ipairs(module:children()) do
    left = left + visit(child)
  end
  if module ~= ctx.model and left >= min_num_params and not containers[module:class_name()] then
    wrap(module, opts)
    return 0
  end
  return left
end

visit(ctx.model)
wrap(ctx.model, fsdp.root_options())
