// Parsing the [model] section.
#include "io/model_source_config.h"

#include "core/config_file.h"
#include "core/dtype.h"
#include "core/error.h"

namespace fsdpp {

ModelSourceConfig ModelSourceConfig::from_section(ConfigSection& s) {
  ModelSourceConfig c;
  c.path = s.get_string("path", "");
  c.dtype = read_dtype(s, "dtype", c.dtype);
  c.init_seed = static_cast<uint64_t>(s.get_int("init_seed", 0, 0, kMaxSeed));
  c.adapter = s.get_string("adapter", "");
  s.finish();
  if (c.path.empty()) s.fail("path", "required: an HF model directory, a checkpoint or a config.json");
  return c;
}

}  // namespace fsdpp
