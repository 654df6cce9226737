// The ranks' settings as "key = value" lines, gathered whole (padded to the longest), so that
// a difference names its keys.
#include "run/rank_agreement.h"

#include "core/error.h"
#include "core/log.h"
#include "io/model_source.h"
#include "models/model_config.h"

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <map>
#include <sstream>
#include <string>
#include <vector>

namespace fsdpp {

namespace {

// Settings that name files, which nodes may keep at other paths (what they hold is compared
// where it matters: the model's config.json here, the plan by require_same_plan), and a
// node's own patience.
const std::vector<std::string> kNodeKeys = {"model.path", "model.adapter", "data.train", "data.eval", "policy.name",
                                            "parallel.timeout_s"};

std::map<std::string, std::string> settings_of(const RunConfig& config, std::optional<int64_t> resumed_step) {
  std::map<std::string, std::string> settings = run_settings(config);
  for (const auto& key : kNodeKeys) settings.erase(key);
  // Outside run_settings, which names what a checkpoint's numbers depend on, but each one
  // decides when every rank meets in a collective.
  settings["train.steps"] = std::to_string(config.train.steps);
  settings["train.eval_every"] = std::to_string(config.train.eval_every);
  settings["train.eval_batches"] = std::to_string(config.train.eval_batches);
  settings["checkpoint.save_every"] = std::to_string(config.checkpoint.save_every);
  settings["checkpoint.save_final"] = config.checkpoint.save_final ? "true" : "false";
  settings["resumed after step"] = resumed_step ? std::to_string(*resumed_step) : "none";
  // Where every rank writes its file of a checkpoint, and rank 0 the rest: ranks that write
  // apart would find at the first save, after the steps before it, that none is complete.
  settings["train.out_dir"] = config.train.out_dir;
  settings["train.reuse_out_dir"] = config.train.reuse_out_dir ? "true" : "false";
  settings["checkpoint.dir"] = config.checkpoint.dir;
  settings["checkpoint.export_dir"] = config.checkpoint.export_dir;
  settings["checkpoint.adapter_dir"] = config.checkpoint.adapter_dir;
  return settings;
}

std::string lines_of(const std::map<std::string, std::string>& settings) {
  std::string text;
  for (const auto& [key, value] : settings) text += key + "\x1f" + value + "\n";
  return text;
}

std::map<std::string, std::string> settings_in(const std::string& text) {
  std::map<std::string, std::string> settings;
  std::istringstream lines(text);
  for (std::string line; std::getline(lines, line);) {
    const auto split = line.find('\x1f');
    if (split != std::string::npos) settings[line.substr(0, split)] = line.substr(split + 1);
  }
  return settings;
}

// The fields in which a rank's model computes otherwise than rank 0's (copies of config.json
// made apart may differ in what builds no other model: _name_or_path, transformers_version).
void require_same_model(const RunConfig& config, Comm& world) {
  const ModelConfig model = model_config_of(config.model);
  const std::vector<std::string> texts = world.all_gather_texts(model.raw->dump());  // read from a file: raw is set
  const ModelConfig first = ModelConfig::from_text(texts[0], "rank 0's config.json");
  for (int r = 1; r < world.size(); ++r) {
    if (texts[r] == texts[0]) continue;
    const std::string origin = "rank " + std::to_string(r) + "'s config.json";
    const ModelConfig other = ModelConfig::from_text(texts[r], origin);
    auto differences = first.differences(other);
    // Changes no output of a model, but each rank draws its own rows of a fresh one from it.
    if (other.initializer_range != first.initializer_range) {
      differences.push_back(concat("initializer_range ", first.initializer_range, " -> ", other.initializer_range));
    }
    if (differences.empty()) continue;
    std::string fields;
    for (const auto& field : differences) fields += (fields.empty() ? "" : ", ") + field;
    throw UserError("rank " + std::to_string(r) + " was given another model than rank 0 (" + fields +
                    ", from rank 0's config.json to rank " + std::to_string(r) +
                    "'s), and every rank must train the same");
  }
}

// UserError naming the first rank whose `values` differ from rank 0's, and each key that does:
// "rank 1 was given <what> than rank 0, and every rank must <must>: key: theirs (rank 0: mine)".
void require_same(const std::map<std::string, std::string>& values, Comm& world, const std::string& what,
                  const std::string& must) {
  const std::vector<std::string> texts = world.all_gather_texts(lines_of(values));
  const auto first = settings_in(texts[0]);
  for (int r = 1; r < world.size(); ++r) {
    if (texts[r] == texts[0]) continue;
    const auto other = settings_in(texts[r]);
    std::string differing;
    auto value_in = [](const std::map<std::string, std::string>& settings, const std::string& key) {
      const auto it = settings.find(key);
      return it == settings.end() ? std::string("unset") : it->second;
    };
    std::map<std::string, std::string> keys = first;
    keys.insert(other.begin(), other.end());
    for (const auto& [key, unused] : keys) {
      const std::string mine = value_in(first, key), theirs = value_in(other, key);
      if (mine == theirs) continue;
      differing += (differing.empty() ? "" : "; ") + key + ": " + theirs + " (rank 0: " + mine + ")";
    }
    throw UserError("rank " + std::to_string(r) + " was given " + what + " than rank 0, and every rank must " + must +
                    ": " + differing);
  }
}

}  // namespace

void require_same_settings(const RunConfig& config, std::optional<int64_t> resumed_step, Comm& world) {
  if (world.size() == 1) return;
  require_same_model(config, world);
  require_same(settings_of(config, resumed_step), world, "other settings", "train by the same");
}

void require_same_sources(const std::map<std::string, std::string>& sources, Comm& world) {
  if (world.size() == 1) return;
  require_same(sources, world, "other files", "train from the same contents");
}

}  // namespace fsdpp
