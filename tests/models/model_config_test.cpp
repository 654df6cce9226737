// config.json as transformers 4.x and 5.x write it: each field read under either version's
// name, to the model transformers 5 reads from the same file (tests/assets/configs, saved
// again by transformers in tests/reference/make_config_fixtures.py), and two names of one
// field that disagree refused on one line naming both; each family's bias switches honoured
// as its transformers classes honour them.
#include "core/error.h"
#include "core/module_tree.h"
#include "models/registry.h"

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

using namespace fsdpp;
using nlohmann::json;

namespace {

// Field by field, so a failure names the field and both values.
void check_same_model(const ModelConfig& a, const ModelConfig& b) {
  CHECK(a.model_type == b.model_type);
  CHECK(a.vocab_size == b.vocab_size);
  CHECK(a.hidden_size == b.hidden_size);
  CHECK(a.intermediate_size == b.intermediate_size);
  CHECK(a.num_hidden_layers == b.num_hidden_layers);
  CHECK(a.num_attention_heads == b.num_attention_heads);
  CHECK(a.num_key_value_heads == b.num_key_value_heads);
  CHECK(a.head_dim == b.head_dim);
  CHECK(a.max_position_embeddings == b.max_position_embeddings);
  CHECK(a.rms_norm_eps == b.rms_norm_eps);
  CHECK(a.rope_theta == b.rope_theta);
  CHECK(a.sliding_window == b.sliding_window);
  CHECK(a.tie_word_embeddings == b.tie_word_embeddings);
  CHECK(a.padding_row == b.padding_row);
  CHECK(a.attention_bias == b.attention_bias);
  CHECK(a.mlp_bias == b.mlp_bias);
  CHECK(a.initializer_range == b.initializer_range);
  CHECK(a.image_token_id == b.image_token_id);
  CHECK(a.video_token_id == b.video_token_id);
  CHECK(a.vision_start_token_id == b.vision_start_token_id);
  CHECK(a.rope_scaling == b.rope_scaling);
  CHECK(a.moe == b.moe);
  CHECK(a.latent_attention == b.latent_attention);
  CHECK(a.vision == b.vision);
  // And so the same parameters, built without memory.
  const auto opts = torch::TensorOptions().device(torch::kMeta);
  const auto pa = unique_named_parameters(*build_model(a, opts)), pb = unique_named_parameters(*build_model(b, opts));
  REQUIRE(pa.size() == pb.size());
  for (size_t i = 0; i < pa.size(); ++i) {
    INFO("parameter " << pa[i].name);
    CHECK(pa[i].name == pb[i].name);
    CHECK(pa[i].tensor.sizes() == pb[i].tensor.sizes());
  }
}

// The UserError `config` raises, which must be one line.
std::string refusal(const json& config) {
  try {
    ModelConfig::from_json(config, "config.json");
  } catch (const UserError& e) {
    const std::string message = e.what();
    CHECK(message.find('\n') == std::string::npos);
    return message;
  }
  FAIL("config.json was read without error");
  return {};
}

json tiny(const std::string& model_type) {
  return {{"model_type", model_type}, {"vocab_size", 37},      {"hidden_size", 24},
          {"intermediate_size", 40},  {"num_hidden_layers", 2}, {"num_attention_heads", 4},
          {"num_key_value_heads", 2}};
}

}  // namespace

TEST_CASE("a config.json reads to the model transformers 5 reads from it, in 4.x or 5.x names", "[models][parity]") {
  // transformers4: as 4.57.1 saved them; minimal: required keys alone, so every default counts.
  const std::string kind = GENERATE("transformers4", "minimal");
  const std::string family = GENERATE("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3", "qwen2_vl",
                                      "qwen2_5_vl");
  const char* fixtures = std::getenv("FSDPP_FIXTURE_DIR");
  REQUIRE(fixtures != nullptr);
  const std::string dir = std::string(fixtures) + "/configs/" + kind + "/" + family;
  INFO(dir << ": original.json against transformers' config.json");
  check_same_model(ModelConfig::from_file(dir + "/original.json"), ModelConfig::from_file(dir + "/config.json"));
}

TEST_CASE("a family builds the decoder biases transformers builds, whatever switches its file sets", "[models][parity]") {
  const std::string family = GENERATE("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3", "qwen2_vl",
                                      "qwen2_5_vl");
  const char* fixtures = std::getenv("FSDPP_FIXTURE_DIR");
  REQUIRE(fixtures != nullptr);
  const std::string dir = std::string(fixtures) + "/configs/biased/" + family;
  INFO(dir << ": attention_bias and mlp_bias set, against transformers' biases.json");
  std::ifstream expected_file(dir + "/biases.json");
  REQUIRE(expected_file);
  const auto expected = json::parse(expected_file).get<std::vector<std::string>>();
  const auto model = build_model(ModelConfig::from_file(dir + "/config.json"), torch::TensorOptions().device(torch::kMeta));
  std::vector<std::string> built;
  for (const auto& p : unique_named_parameters(*model)) {
    const auto layers = p.name.find("layers.");
    if (layers != std::string::npos && p.name.ends_with(".bias") && p.name.find("visual") == std::string::npos) {
      built.push_back(p.name.substr(layers));
    }
  }
  std::sort(built.begin(), built.end());
  CHECK(built == expected);
}

TEST_CASE("two names of one config.json field must agree", "[models]") {
  auto moe = tiny("qwen3_moe");
  moe.update({{"num_experts", 6}, {"num_experts_per_tok", 2}, {"moe_intermediate_size", 8}});
  SECTION("either name, or both agreeing, gives the experts") {
    auto renamed = moe;
    renamed.erase("num_experts");
    renamed["num_local_experts"] = 6;
    auto both = renamed;
    both["num_experts"] = 6;
    for (const auto& config : {moe, renamed, both}) CHECK(ModelConfig::from_json(config, "config.json").moe->num_experts == 6);
  }
  SECTION("disagreeing, both are named") {
    moe["num_local_experts"] = 7;
    CHECK(refusal(moe) == "config.json: num_local_experts 7 and num_experts 6 disagree (two names of one field)");
    auto absent = tiny("qwen3_moe");
    absent.update({{"num_experts_per_tok", 2}, {"moe_intermediate_size", 8}});
    CHECK(refusal(absent) == "config.json: missing key 'num_local_experts'");
  }
  SECTION("DeepSeek-V3's experts under transformers 5's other name") {
    auto deepseek = tiny("deepseek_v3");
    deepseek.update({{"num_local_experts", 8}, {"num_experts_per_tok", 2}, {"n_group", 2}, {"topk_group", 1},
                     {"q_lora_rank", nullptr}, {"first_k_dense_replace", 0}});
    CHECK(ModelConfig::from_json(deepseek, "config.json").moe->num_experts == 8);
    deepseek["n_routed_experts"] = 16;
    CHECK(refusal(deepseek) == "config.json: n_routed_experts 16 and num_local_experts 8 disagree (two names of one field)");
  }
  SECTION("DeepSeek-V3's switches read null as false, as transformers tests them (if config.norm_topk_prob:)") {
    auto deepseek = tiny("deepseek_v3");
    deepseek.update({{"n_routed_experts", 8}, {"num_experts_per_tok", 2}, {"n_group", 2}, {"topk_group", 1},
                     {"first_k_dense_replace", 0}});
    const auto defaults = ModelConfig::from_json(deepseek, "config.json");
    CHECK(defaults.moe->norm_topk_prob);
    CHECK(defaults.latent_attention->rope_interleave);
    deepseek.update({{"norm_topk_prob", nullptr}, {"rope_interleave", nullptr}});
    const auto nulls = ModelConfig::from_json(deepseek, "config.json");
    CHECK_FALSE(nulls.moe->norm_topk_prob);
    CHECK_FALSE(nulls.latent_attention->rope_interleave);
  }
  SECTION("dtype and torch_dtype") {
    auto config = tiny("llama");
    config.update({{"dtype", "bfloat16"}, {"torch_dtype", "bfloat16"}});
    CHECK_NOTHROW(ModelConfig::from_json(config, "config.json"));
    config["torch_dtype"] = "float32";
    CHECK(refusal(config) == "config.json: dtype \"bfloat16\" and torch_dtype \"float32\" disagree (two names of one field)");
    config.erase("dtype");
    config["torch_dtype"] = 5;
    CHECK(refusal(config) == "config.json: torch_dtype must be a string, got 5");
  }
  SECTION("the vision tower's depth and heads") {
    auto config = json::parse(R"({"model_type": "qwen2_vl", "image_token_id": 30, "video_token_id": 31,
      "vision_start_token_id": 32, "rope_scaling": {"type": "mrope", "mrope_section": [1, 1, 1]},
      "vision_config": {"num_hidden_layers": 2, "num_attention_heads": 2, "embed_dim": 8, "hidden_size": 24}})");
    config.update(tiny("qwen2_vl"));
    CHECK(ModelConfig::from_json(config, "config.json").vision->depth == 2);
    config["vision_config"]["depth"] = 3;
    CHECK(refusal(config) ==
          "config.json: vision_config: depth 3 and num_hidden_layers 2 disagree (two names of one field)");
  }
}

TEST_CASE("RoPE is read from rope_parameters, rope_scaling and the top level alike", "[models]") {
  auto config = tiny("llama");
  const json llama3 = {{"rope_type", "llama3"}, {"factor", 8.0}, {"low_freq_factor", 1.0}, {"high_freq_factor", 4.0},
                       {"original_max_position_embeddings", 16}};
  SECTION("4.x: rope_theta at the top, rope_scaling; 5.x: both in rope_parameters") {
    auto old = config, now = config;
    old.update({{"rope_theta", 5e5}, {"rope_scaling", llama3}});
    now["rope_parameters"] = llama3;
    now["rope_parameters"]["rope_theta"] = 5e5;
    const auto a = ModelConfig::from_json(old, "config.json"), b = ModelConfig::from_json(now, "config.json");
    CHECK(a.rope_theta == 5e5);
    CHECK(a.rope_scaling.rope_type == RopeType::llama3);
    CHECK(a.rope_theta == b.rope_theta);
    CHECK(a.rope_scaling == b.rope_scaling);
  }
  SECTION("a value two places give differently is refused, naming both") {
    config.update({{"rope_theta", 1e4}, {"rope_parameters", {{"rope_theta", 5e5}, {"rope_type", "default"}}}});
    CHECK(refusal(config) ==
          "config.json: rope_theta 10000.0 and rope_parameters.rope_theta 500000.0 disagree (two places of one field)");
  }
  SECTION("rope_scaling, where a file has a non-empty one, stands in for rope_parameters whole") {
    config["rope_parameters"] = {{"rope_type", "linear"}, {"factor", 2.0}, {"rope_theta", 5e5}};
    config["rope_scaling"] = {{"type", "linear"}, {"factor", 3.0}};
    const auto scaled = ModelConfig::from_json(config, "config.json");
    CHECK(scaled.rope_scaling.factor == 3.0);
    CHECK(scaled.rope_theta == 1e4);  // Llama's default: rope_parameters' theta is not read
    config["rope_scaling"] = json::object();
    CHECK(ModelConfig::from_json(config, "config.json").rope_scaling.factor == 2.0);
  }
  SECTION("the original context at the top wins; YaRN's null factor is the context's growth") {
    config["max_position_embeddings"] = 64;
    config["original_max_position_embeddings"] = 16;
    config["rope_parameters"] = {{"rope_type", "yarn"}, {"factor", nullptr}, {"original_max_position_embeddings", 32}};
    const auto yarn = ModelConfig::from_json(config, "config.json");
    CHECK(yarn.rope_scaling.original_max_position_embeddings == 16);
    CHECK(yarn.rope_scaling.factor == 4.0);
    CHECK(yarn.rope_scaling.truncate);
    config["rope_parameters"]["truncate"] = nullptr;  // tested for truth, as transformers does
    CHECK_FALSE(ModelConfig::from_json(config, "config.json").rope_scaling.truncate);
  }
  SECTION("what the engine does not do is refused, not ignored") {
    auto partial = config, nested = config, sliding = config;
    partial["partial_rotary_factor"] = 0.5;
    CHECK(refusal(partial) == "config.json: rope_parameters: partial_rotary_factor 0.5 is not supported (1.0)");
    nested["rope_parameters"] = {{"full_attention", {{"rope_theta", 1e4}}}};
    CHECK(refusal(nested) ==
          "config.json: rope_parameters.full_attention: RoPE parameters per layer type are not supported");
    auto dropping = config;
    dropping["attention_dropout"] = 0.1;
    CHECK(refusal(dropping) == "config.json: attention_dropout 0.1 is not supported (0.0)");
    sliding["layer_types"] = {"full_attention", "sliding_attention"};
    CHECK(refusal(sliding) ==
          "config.json: layer_types[1] 'sliding_attention' is not supported (every layer 'full_attention' here)");
  }
  SECTION("a theta whose frequencies rise, vanish or divide by zero") {
    for (double theta : {1.0, 1e-300}) {
      auto low = config;
      low["rope_parameters"]["rope_theta"] = theta;
      CHECK(refusal(low).starts_with("config.json: rope_theta must be above 1 and at most 1e300, got "));
    }
  }
}

TEST_CASE("another architecture's file is refused by its model_type, naming the file, before its fields", "[models]") {
  json gpt2 = {{"model_type", "gpt2"}, {"n_embd", 24}};
  CHECK_THAT(refusal(gpt2), Catch::StartsWith("config.json: model_type 'gpt2' is not supported (known: deepseek_v3, "));
  // The types read are the types built.
  auto built = registered_model_types();
  std::sort(built.begin(), built.end());
  CHECK(built == supported_model_types());
}

TEST_CASE("a sequence-classification file builds a score head of its labels, never tied", "[models]") {
  auto reward = tiny("llama");
  reward["architectures"] = {"LlamaForSequenceClassification"};
  reward["tie_word_embeddings"] = true;
  // transformers counts the labels by id2label, and defaults to 2.
  CHECK(ModelConfig::from_json(reward, "config.json").num_labels == 2);
  reward["id2label"] = {{"0", "LABEL_0"}};
  const ModelConfig config = ModelConfig::from_json(reward, "config.json");
  CHECK(config.num_labels == 1);
  CHECK_FALSE(config.tie_word_embeddings);
  auto model = build_model(config, torch::TensorOptions().device(torch::kMeta));
  CHECK(model->class_name() == "LlamaForSequenceClassification");
  CHECK(model->output_head_weight().sizes() == torch::IntArrayRef{1, config.hidden_size});
  std::vector<std::string> names;
  for (const auto& p : unique_named_parameters(*model)) names.push_back(p.name);
  CHECK(std::count(names.begin(), names.end(), "score.weight") == 1);
  CHECK(std::count(names.begin(), names.end(), "lm_head.weight") == 0);
  // num_labels, where the file gives it, over an id2label of another size, as transformers 5.
  reward["id2label"] = {{"0", "LABEL_0"}, {"1", "LABEL_1"}};
  reward["num_labels"] = 1;
  CHECK(ModelConfig::from_json(reward, "config.json").num_labels == 1);
  reward.erase("num_labels");
  reward["architectures"] = {"LlamaForTokenClassification"};
  CHECK(refusal(reward) == "config.json: architectures names LlamaForTokenClassification, whose head fsdpp does not "
                           "build (it builds ...ForCausalLM, ...ForConditionalGeneration and "
                           "...ForSequenceClassification models)");
  reward["architectures"] = {"Qwen2ForRewardModel"};
  CHECK_THAT(refusal(reward), Catch::StartsWith("config.json: architectures names Qwen2ForRewardModel, whose head"));
  reward["architectures"] = {"LlamaForSequenceClassification"};
  reward["id2label"] = json::object();
  reward["num_labels"] = 0;
  CHECK_THAT(refusal(reward), Catch::Contains("num_labels"));
}

TEST_CASE("scales nothing else bounds are range-checked where they enter, before a run of NaN losses", "[models]") {
  auto llama = tiny("llama");
  llama["initializer_range"] = 1e300;
  CHECK_THAT(refusal(llama), Catch::StartsWith("config.json: initializer_range must be in [0.0, 10.0], got 1e+300"));
  auto deepseek = tiny("deepseek_v3");
  deepseek["first_k_dense_replace"] = 1;
  for (auto [family, key] : {std::pair{"deepseek_v3", "routed_scaling_factor"}, {"qwen3_moe", "router_aux_loss_coef"}}) {
    auto big = std::string(family) == "deepseek_v3" ? deepseek : tiny(family);
    if (std::string(family) == "qwen3_moe") big.update({{"num_experts", 4}, {"num_experts_per_tok", 2}, {"moe_intermediate_size", 8}});
    big[key] = 1e300;
    CHECK_THAT(refusal(big), Catch::Contains(std::string(key) + " must be in [0.0, 1000.0]"));
  }
  for (const char* key : {"mscale", "mscale_all_dim"}) {
    auto scaled = deepseek;
    scaled["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 4.0}, {"original_max_position_embeddings", 16}, {key, -1e300}};
    CHECK_THAT(refusal(scaled), Catch::Contains(std::string(key) + " must be in [0.0, 1000.0]"));
  }
}

TEST_CASE("a multimodal file ties its embeddings where either version put the key", "[models]") {
  auto config = json::parse(R"({"model_type": "qwen2_vl", "image_token_id": 30, "video_token_id": 31,
    "vision_start_token_id": 32, "vision_config": {"depth": 1, "num_heads": 2, "embed_dim": 8, "hidden_size": 24}})");
  config["text_config"] = tiny("qwen2_vl");
  config["text_config"]["rope_scaling"] = {{"type", "mrope"}, {"mrope_section", {1, 1, 1}}};
  CHECK_FALSE(ModelConfig::from_json(config, "config.json").tie_word_embeddings);
  auto top = config, inner = config;
  top["tie_word_embeddings"] = true;
  inner["text_config"]["tie_word_embeddings"] = true;
  CHECK(ModelConfig::from_json(top, "config.json").tie_word_embeddings);
  CHECK(ModelConfig::from_json(inner, "config.json").tie_word_embeddings);
  // The rest of the language model comes from text_config alone, as transformers reads it:
  // the defaults fill what it lacks, not the top level.
  auto leaky = config;
  leaky.update({{"rms_norm_eps", 0.5}, {"rope_theta", 500.0}, {"pad_token_id", 3}});
  leaky["text_config"].erase("rms_norm_eps");
  const auto text = ModelConfig::from_json(leaky, "config.json");
  CHECK(text.rms_norm_eps == 1e-5);
  CHECK(text.rope_theta == 1e6);
  CHECK(text.padding_row == -1);
}

TEST_CASE("pad_token_id names the embedding row without a gradient, counting from the end when negative",
          "[models]") {
  auto config = tiny("llama");
  CHECK(ModelConfig::from_json(config, "config.json").padding_row == -1);
  config["pad_token_id"] = nullptr;
  CHECK(ModelConfig::from_json(config, "config.json").padding_row == -1);
  const int64_t vocab = config["vocab_size"].get<int64_t>();
  config["pad_token_id"] = 5;
  CHECK(ModelConfig::from_json(config, "config.json").padding_row == 5);
  config["pad_token_id"] = -1;  // nn.Embedding's padding_idx = -1: the last row
  CHECK(ModelConfig::from_json(config, "config.json").padding_row == vocab - 1);
  // A fresh model starts the row at zero, as transformers' initialisation does.
  const auto model = build_model(ModelConfig::from_json(config, "config.json"), at::TensorOptions(at::kFloat));
  init_parameters(*model, /*seed=*/3, 0.02);
  at::Tensor embedding;  // [V, C]
  for (const auto& p : unique_named_parameters(*model)) {
    if (p.name == "model.embed_tokens.weight") embedding = p.tensor;
  }
  REQUIRE(embedding.defined());
  CHECK(embedding[vocab - 1].abs().sum().item<double>() == 0.0);
  CHECK(embedding[0].abs().sum().item<double>() > 0.0);
  config["pad_token_id"] = vocab;
  CHECK(refusal(config) == "config.json: pad_token_id must be in [" + std::to_string(-vocab) + ", " +
                               std::to_string(vocab - 1) + "], got " + std::to_string(vocab));
}
