-- Wrap policy for any transformer: the model's no_split_modules plus the classes listed in
-- [policy.options] classes = "A,B" become units, then embeddings, lm_head and the root.
local fsdp = require("fsdp")
local classes = {}
for class in string.gmatch(ctx.options.classes or "", "[^,%s]+") do classes[#classes + 1] = class end
fsdp.standard{classes = classes}
