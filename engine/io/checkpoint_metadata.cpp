// Parsing and validating checkpoint metadata.
#include "io/checkpoint_metadata.h"

#include "core/config_file.h"
#include "core/dtype.h"
#include "core/error.h"
#include "core/json_text.h"
#include "core/mapped_file.h"
#include "io/safetensors_header.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>

namespace fsdpp {

namespace {

using nlohmann::json;

// An integer in [min, max]; another type or a value out of range names the field.
int64_t int_value(const json& value, const std::string& name, int64_t min, int64_t max) {
  const bool too_big = value.is_number_unsigned() && value.get<uint64_t>() > static_cast<uint64_t>(max);
  if (!value.is_number_integer() || too_big || value.get<int64_t>() < min || value.get<int64_t>() > max) {
    throw UserError(name + " must be an integer in [" + std::to_string(min) + ", " + std::to_string(max) + "], got " +
                    value.dump());
  }
  return value.get<int64_t>();
}

int64_t int_field(const json& parent, const std::string& path, const char* key, int64_t min, int64_t max) {
  const std::string name = path.empty() ? key : path + "." + key;
  if (!parent.is_object() || !parent.contains(key)) throw UserError(name + " is missing");
  return int_value(parent.at(key), name, min, max);
}

// What the run keeps beside its state: counts, and the last step's loss (null where it was
// not finite, JSON having no NaN).
void check_client_state(const json& client) {
  int_field(client, "client_state", "skipped_steps", 0, kMaxSteps);
  if (client.contains("tokens_seen")) int_value(client.at("tokens_seen"), "client_state.tokens_seen", 0, INT64_MAX);
  if (client.contains("loss") && !client.at("loss").is_number() && !client.at("loss").is_null()) {
    throw UserError("client_state.loss is not a number");
  }
}

// `parent[key]`, where present, as `is` says it must be (`what`: "a string", ...).
void check_type(const json& parent, const std::string& path, const char* key, bool (json::*is)() const noexcept,
                const char* what) {
  if (parent.contains(key) && !(parent.at(key).*is)()) throw UserError(path + "." + key + " is not " + what);
}

bool strings_only(const json& value) {
  return std::all_of(value.begin(), value.end(), [](const json& v) { return v.is_string(); });
}

// The model's record, as the readers of a checkpoint's LoRA plan and base identity take it.
void check_model(const json& model) {
  if (!model.is_object()) throw UserError("model is not an object");
  parse_dtype(model.at("dtype").get<std::string>());
  check_type(model, "model", "source", &json::is_string, "a string");
  if (model.contains("lora")) {
    const json& lora = model.at("lora");
    if (!lora.is_object() || !lora.value("origin", json()).is_string()) throw UserError("model.lora names no origin");
    for (const char* list : {"targets", "trainable"}) {
      if (!lora.is_object() || !lora.contains(list) || !lora.at(list).is_array() || !strings_only(lora.at(list))) {
        throw UserError("model.lora." + std::string(list) + " is not a list of module names");
      }
    }
    int_field(lora, "model.lora", "rank", 1, 65536);
    const json alpha = lora.value("alpha", json()), dropout = lora.value("dropout", json());
    if (!alpha.is_number() || !(alpha.get<double>() > 0) || !std::isfinite(alpha.get<double>()) ||
        !dropout.is_number() || !(dropout.get<double>() >= 0 && dropout.get<double>() < 1)) {
      throw UserError("model.lora's alpha must be positive and its dropout in [0, 1)");
    }
  }
  if (model.contains("base")) {
    const json& base = model.at("base");
    if (!base.is_object() || !base.value("path", json()).is_string()) throw UserError("model.base names no path");
    check_type(base, "model.base", "config.json", &json::is_string, "a string");
    check_type(base, "model.base", "init_seed", &json::is_number_unsigned, "an integer >= 0");
    if (base.contains("files") && (!base.at("files").is_object() || !strings_only(base.at("files")))) {
      throw UserError("model.base.files is not an object of checksums");
    }
  }
}

// A tensor shape: dimensions >= 0 whose product fits the sizes tensors may have.
std::vector<int64_t> shape_field(const json& record, const std::string& key) {
  const json& shape = record.at("shape");
  if (!shape.is_array()) throw UserError("tensor '" + key + "': shape is not a list");
  std::vector<int64_t> dims;
  int64_t elements = 1;
  for (const json& d : shape) dims.push_back(int_value(d, "tensor '" + key + "' shape", 0, int64_t{1} << 40));
  for (int64_t d : dims) {
    if (d != 0 && elements > (int64_t{1} << 48) / d) throw UserError("tensor '" + key + "': shape holds too many elements");
    elements *= d;
  }
  return dims;
}

// One tensor's record; its shards must name listed files and tile its rows exactly.
TensorRecord tensor_record(const std::string& key, const json& t, const std::map<std::string, FileRecord>& files) {
  TensorRecord r{safetensors_dtype(t.at("dtype").get<std::string>(), key), shape_field(t, key), {}};
  const int64_t rows_total = row_count(r.shape);
  for (const auto& s : t.at("shards")) {
    const json& rows = s.at("rows");
    if (!rows.is_array() || rows.size() != 2) throw UserError("tensor '" + key + "': a shard's rows are not [first, count]");
    const std::string where = "tensor '" + key + "' shard rows";
    r.shards.push_back({s.at("file").get<std::string>(), int_value(rows[0], where, 0, rows_total),
                        int_value(rows[1], where, 0, rows_total)});
    if (!files.count(r.shards.back().file)) {
      throw UserError("tensor '" + key + "' names file " + r.shards.back().file + ", which files does not list");
    }
  }
  std::sort(r.shards.begin(), r.shards.end(), [](const auto& a, const auto& b) { return a.first_row < b.first_row; });
  int64_t next = 0;
  for (const auto& s : r.shards) {
    if (s.first_row != next) {
      throw UserError("tensor '" + key + "': shards do not tile its rows (row " + std::to_string(next) + " expected, " +
                      std::to_string(s.first_row) + " found)");
    }
    next += s.rows;
  }
  if (next != rows_total) {
    throw UserError("tensor '" + key + "': shards hold " + std::to_string(next) + " of its " +
                    std::to_string(rows_total) + " rows");
  }
  return r;
}

}  // namespace

int64_t row_count(const std::vector<int64_t>& shape) { return shape.empty() ? 1 : shape[0]; }

CheckpointMetadata CheckpointMetadata::parse(const std::string& text) {
  try {
    auto meta = std::make_shared<json>(parse_json(text, "malformed checkpoint metadata"));
    if (!meta->is_object() || meta->value("format", "") != kCheckpointFormat) {
      throw UserError("not a " + std::string(kCheckpointFormat));
    }
    if (meta->value("version", 0) != 1) throw UserError("version " + meta->value("version", json()).dump() + " is not 1");
    CheckpointMetadata m;
    m.step = int_field(*meta, "", "step", 0, kMaxSteps);
    m.world_size = static_cast<int>(int_field(*meta, "", "world_size", 1, kMaxWorldSize));
    int_field(meta->at("optimizer"), "optimizer", "steps", 0, kMaxSteps);
    if (!meta->at("data").is_null()) {  // null: saved by a run fed by its caller, with no data position
      int_field(meta->at("data"), "data", "epoch", 0, INT64_MAX);
      int_field(meta->at("data"), "data", "window", 0, INT64_MAX);
    }
    check_model(meta->at("model"));
    if (meta->contains("scheduler")) {
      const json& scheduler = meta->at("scheduler");
      if (!scheduler.is_object()) throw UserError("scheduler is not an object");
      if (scheduler.contains("total_steps")) int_field(scheduler, "scheduler", "total_steps", 0, kMaxSteps);
    }
    const json run = meta->value("run", json::object());
    if (!run.is_object() || !run.value("out_dir", json("")).is_string()) {
      throw UserError("run.out_dir is not a string");
    }
    if (meta->contains("config_hash") && !meta->at("config_hash").is_string()) throw UserError("config_hash is not a string");
    if (meta->contains("settings")) {
      const json& settings = meta->at("settings");
      if (!settings.is_object() || !std::all_of(settings.begin(), settings.end(), [](const json& v) { return v.is_string(); })) {
        throw UserError("settings is not an object of strings");
      }
    }
    if (meta->contains("client_state")) check_client_state(meta->at("client_state"));
    for (const auto& [name, f] : meta->at("files").items()) {
      if (!is_plain_file_name(name)) {
        throw UserError("files names '" + name + "', outside the checkpoint (only plain file names are allowed)");
      }
      const auto bytes = static_cast<uint64_t>(int_field(f, "files." + name, "bytes", 0, INT64_MAX));
      m.files[name] = {bytes, f.at("checksum").get<std::string>()};
    }
    for (const auto& [key, t] : meta->at("tensors").items()) m.tensors.emplace(key, tensor_record(key, t, m.files));
    m.document = std::move(meta);
    return m;
  } catch (const json::exception& e) {
    throw UserError("malformed checkpoint metadata (" + std::string(e.what()) + ")");
  }
}

}  // namespace fsdpp
