// Typed, range-checked reads of config.json fields, shared by the model config and its
// sections (rope scaling, vision tower, experts, latent attention). Every error names the
// file (or section) and key.
#pragma once

#include "core/error.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <type_traits>
#include <vector>

namespace fsdpp::config_fields {

// Sizes beyond any model this engine can hold, and far from where size arithmetic overflows.
constexpr int64_t kMaxVocab = int64_t{1} << 24;
constexpr int64_t kMaxWidth = int64_t{1} << 20;  // hidden, intermediate, head_dim
constexpr int64_t kMaxLayers = 4096;
constexpr int64_t kMaxHeads = 4096;
constexpr int64_t kMaxPositions = int64_t{1} << 24;
constexpr int64_t kMaxExperts = 4096;
constexpr double kMaxParameters = 1e12;

// `key` of `j` as a T; `fallback` when absent or null, unless `required`.
template <class T>
T read(const nlohmann::json& j, const std::string& key, const std::string& origin, const T& fallback,
       bool required = false) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) {
    if (required) throw UserError(origin + ": missing key '" + key + "'");
    return fallback;
  }
  // JSON numbers convert silently (2.5 layers would load as 2): integers must be integers,
  // and every number finite.
  if constexpr (std::is_integral_v<T> && !std::is_same_v<T, bool>) {
    if (!it->is_number_integer()) throw UserError(origin + ": " + key + " must be an integer, got " + it->dump());
  }
  if constexpr (std::is_same_v<T, std::vector<int64_t>>) {
    if (!it->is_array() ||
        !std::all_of(it->begin(), it->end(), [](const nlohmann::json& v) { return v.is_number_integer(); })) {
      throw UserError(origin + ": " + key + " must be a list of integers, got " + it->dump());
    }
  }
  if constexpr (std::is_same_v<T, bool>) {
    if (!it->is_boolean()) throw UserError(origin + ": " + key + " must be true or false, got " + it->dump());
  }
  if constexpr (std::is_same_v<T, std::string>) {
    if (!it->is_string()) throw UserError(origin + ": " + key + " must be a string, got " + it->dump());
  }
  if constexpr (std::is_floating_point_v<T>) {
    if (!it->is_number() || !std::isfinite(it->get<double>())) {
      throw UserError(origin + ": " + key + " must be a finite number, got " + it->dump());
    }
  }
  try {
    return it->get<T>();
  } catch (const nlohmann::json::exception&) {
    throw UserError(origin + ": key '" + key + "' has the wrong type (" + it->type_name() + ")");
  }
}

// `key` of `j` where null means something other than absent: `if_null` for null, `read`'s
// `fallback` (transformers' default) when absent.
template <class T>
T read_nullable(const nlohmann::json& j, const std::string& key, const std::string& origin, const T& fallback,
                const T& if_null) {
  return j.contains(key) && j.at(key).is_null() ? if_null : read<T>(j, key, origin, fallback);
}

// A field's names across transformers versions, the one 5.x writes first. Its config classes
// map old names to new ones (attribute_map): Qwen3-MoE's num_experts is saved as
// num_local_experts by 5.x, and 4.x files on the Hub keep the old name.
using Spellings = std::initializer_list<const char*>;

// The key under which `j` holds the field: the first of `spellings` present and not null, or
// the first spelling when none is. Two spellings present with different values are refused,
// naming both.
inline std::string spelled_key(const nlohmann::json& j, Spellings spellings, const std::string& origin) {
  const char* found = nullptr;
  for (const char* key : spellings) {
    auto it = j.find(key);
    if (it == j.end() || it->is_null()) continue;
    if (found == nullptr) {
      found = key;
    } else if (*it != j.at(found)) {
      throw UserError(origin + ": " + found + " " + j.at(found).dump() + " and " + key + " " + it->dump() +
                      " disagree (two names of one field)");
    }
  }
  return found != nullptr ? found : *spellings.begin();
}

// `read` of the field under whichever of its spellings `j` uses.
template <class T>
T read_spelled(const nlohmann::json& j, Spellings spellings, const std::string& origin, const T& fallback,
               bool required = false) {
  const std::string key = spelled_key(j, spellings, origin);
  if (required && (!j.contains(key) || j.at(key).is_null())) {
    std::string names;
    for (const char* name : spellings) names += (names.empty() ? "'" : " or '") + std::string(name) + "'";
    throw UserError(origin + ": missing key " + names);
  }
  return read<T>(j, key, origin, fallback);
}

inline void check_range(const std::string& origin, const std::string& key, int64_t value, int64_t min, int64_t max) {
  if (value < min || value > max) {
    throw UserError(origin + ": " + key + " must be in [" + std::to_string(min) + ", " + std::to_string(max) + "], got " +
                    std::to_string(value));
  }
}

// For scales whose size nothing bounds in transformers: past these, every step's loss is NaN.
inline void check_between(const std::string& origin, const std::string& key, double value, double min, double max) {
  if (!(value >= min && value <= max)) {
    throw UserError(origin + ": " + key + " must be in [" + nlohmann::json(min).dump() + ", " +
                    nlohmann::json(max).dump() + "], got " + nlohmann::json(value).dump());
  }
}

inline void check_positive(const std::string& origin, const std::string& key, double value) {
  if (!(value > 0)) throw UserError(origin + ": " + key + " must be positive, got " + nlohmann::json(value).dump());
}

// RoPE's frequencies are theta^(-2i/d): a theta at or below 1 makes them rise, or divide by
// zero where YaRN takes its logarithm; past 1e300 they are zero.
inline void check_rope_theta(const std::string& origin, double value) {
  if (!(value > 1 && value <= 1e300)) {
    throw UserError(origin + ": rope_theta must be above 1 and at most 1e300, got " + nlohmann::json(value).dump());
  }
}

}  // namespace fsdpp::config_fields
