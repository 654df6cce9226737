-- Wrap policy for any transformer: the model's no_split_modules plus the classes listed in
-- [policy.options] classes = "A,B" become units, then embeddings, lm_head and the root.
local fsdp = require("fsdp")
local classes = {}
local listed = options{classes = {"string", default = "", doc = "comma-separated module classes to wrap besides no_split_modules"}}.classes
for class in string.gmatch(listed, "[^,%s]+") do classes[#classes + 1] = class end
fsdp.standard{classes = classes}
