// Parsing the [data] section.
#include "data/data_config.h"

#include "core/config_file.h"

namespace fsdpp {

DataConfig DataConfig::from_section(ConfigSection& s) {
  DataConfig c;
  c.train = s.get_string("train", "");
  c.seq_len = s.get_int("seq_len", c.seq_len, 1, kMaxBatchTokens);
  c.batch_size = s.get_int("batch_size", c.batch_size, 1, kMaxBatchTokens);
  c.eval_fraction = s.get_double("eval_fraction", c.eval_fraction, 0, 1, ConfigSection::Max::excluded);
  c.seed = static_cast<uint64_t>(s.get_int("seed", 0, 0, kMaxSeed));
  c.shuffle = s.get_bool("shuffle", c.shuffle);
  c.packing = s.get_bool("packing", c.packing);
  c.train_on = s.get_choice("train_on", c.train_on, {{"all", TrainOn::all}, {"completion", TrainOn::completion}});
  c.long_documents = s.get_choice("long_documents", c.long_documents,
                                  {{"split", LongDocumentRule::split}, {"truncate", LongDocumentRule::truncate},
                                   {"drop", LongDocumentRule::drop}});
  s.finish();
  if (c.batch_size > kMaxBatchTokens / c.seq_len) {
    s.fail("batch_size", "a global batch of " + std::to_string(c.batch_size) + " x " + std::to_string(c.seq_len) +
                             " tokens is more than " + std::to_string(kMaxBatchTokens) + " (batch_size x seq_len)");
  }
  return c;
}

}  // namespace fsdpp
