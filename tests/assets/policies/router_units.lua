-- Each DeepSeek-V3 router a unit of its own that frees its gathered parameters after its
-- forward, inside the shipped rule's layer units: its layer must read nothing of the router
-- once it has called it (tests/fsdp/moe.sh).
local fsdp = require("fsdp")
fsdp.wrap_classes(ctx.float32_modules, fsdp.unit_options{reshard_after_forward = true})
fsdp.standard{classes = {"DeepseekV3DecoderLayer"}}
