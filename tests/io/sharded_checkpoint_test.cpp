// Checkpoint files: the checksum, streamed writers, reading rows across shards, metadata
// that does not add up, and rotation that never deletes the newest complete checkpoint.
#include "core/checksum.h"
#include "core/error.h"
#include "core/mapped_file.h"
#include "io/hf_dir.h"
#include "io/hf_export.h"
#include "io/sharded_checkpoint.h"
#include "scratch_dir.h"

#include <ATen/ATen.h>
#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <fstream>
#include <functional>

using namespace fsdpp;
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

// A checkpoint of one [5, 3] tensor "model/w" split as rows 0-1 in rank 0's file and 2-4 in
// rank 1's, with metadata written from `tweak`ed JSON.
fs::path two_rank_checkpoint(const fs::path& dir, const at::Tensor& full, const std::function<void(json&)>& tweak = {}) {
  fs::create_directories(dir);
  json meta = {{"format", kCheckpointFormat}, {"version", 1}, {"step", 7}, {"world_size", 2},
               {"optimizer", {{"steps", 7}}}, {"data", {{"epoch", 0}, {"window", 3}}}, {"model", {{"dtype", "float32"}}}};
  const std::pair<int64_t, int64_t> rows[] = {{0, 2}, {2, 3}};
  for (int r = 0; r < 2; ++r) {
    SafetensorsWriter writer(dir / rank_file_name(r), {{"model/w", at::kFloat, {rows[r].second, 3}}});
    writer.write(full.narrow(0, rows[r].first, rows[r].second));
    writer.commit();
    meta["files"][rank_file_name(r)] = {{"bytes", writer.size()}, {"checksum", format_crc32c(writer.checksum())}};
    meta["tensors"]["model/w"]["shards"].push_back({{"file", rank_file_name(r)}, {"rows", {rows[r].first, rows[r].second}}});
  }
  meta["tensors"]["model/w"]["dtype"] = "F32";
  meta["tensors"]["model/w"]["shape"] = {5, 3};
  if (tweak) tweak(meta);
  const std::string text = meta.dump();
  std::ofstream(dir / "metadata.json") << text;
  std::ofstream(dir / kMetadataChecksumFile) << format_crc32c(crc32c(text.data(), text.size())) << "\n";
  return dir;
}

std::string open_error(const fs::path& dir) {
  try {
    ShardedCheckpoint::open(dir).read_full("model/w");
  } catch (const UserError& e) {
    return e.what();
  }
  return "";
}

void fake_checkpoint(const fs::path& root, int64_t step, size_t bytes) {
  const fs::path dir = checkpoint_path(root, step);
  fs::create_directories(dir);
  std::ofstream(dir / "metadata.json") << std::string(bytes, 'x');
}

}  // namespace

TEST_CASE("crc32c: the standard check value, and continuing equals one pass", "[checkpoint]") {
  const std::string text = "123456789";
  CHECK(crc32c(text.data(), text.size()) == 0xE3069283u);
  CHECK(crc32c(text.data() + 4, 5, crc32c(text.data(), 4)) == 0xE3069283u);
  CHECK(format_crc32c(0xE3069283u) == "crc32c:e3069283");
}

TEST_CASE("sharded checkpoint: rows are read across shard boundaries, and every file is checked", "[checkpoint]") {
  const fs::path dir = testing::scratch_dir("ckpt") / "good";
  const at::Tensor full = at::arange(15, at::kFloat).view({5, 3});
  two_rank_checkpoint(dir, full);
  const auto checkpoint = ShardedCheckpoint::open(dir);
  CHECK(checkpoint.step() == 7);
  at::Tensor rows = at::empty({3, 3}, at::kDouble);  // rows 1-3 span both files; converted to double
  checkpoint.read_rows("model/w", rows, 1);
  CHECK(at::equal(rows, full.narrow(0, 1, 3).to(at::kDouble)));
  CHECK(at::equal(checkpoint.read_full("model/w"), full));
  CHECK(checkpoint.read_stats().bytes == (9 + 15) * 4);  // counted in the stored dtype, float32
}

TEST_CASE("sharded checkpoint: metadata that does not add up is refused naming the file", "[checkpoint]") {
  const fs::path root = testing::scratch_dir("ckpt");
  const at::Tensor full = at::arange(15, at::kFloat).view({5, 3});
  const auto gap = two_rank_checkpoint(root / "gap", full, [](json& m) { m["tensors"]["model/w"]["shards"][1]["rows"] = {3, 2}; });
  CHECK_THAT(open_error(gap), Catch::Contains("gap/metadata.json") && Catch::Contains("do not tile"));
  const auto short_rows = two_rank_checkpoint(root / "short", full, [](json& m) { m["tensors"]["model/w"]["shape"] = {6, 3}; });
  CHECK_THAT(open_error(short_rows), Catch::Contains("hold 5 of its 6 rows"));
  const auto wrong_sum = two_rank_checkpoint(root / "sum", full, [](json& m) { m["files"][rank_file_name(1)]["checksum"] = "crc32c:00000000"; });
  CHECK_THAT(open_error(wrong_sum), Catch::Contains("rank-00001.safetensors") && Catch::Contains("checksum"));
  const auto loss = two_rank_checkpoint(root / "loss", full, [](json& m) {
    m["client_state"] = {{"skipped_steps", 0}, {"loss", "nan"}};
  });
  CHECK_THAT(open_error(loss), Catch::Contains("loss/metadata.json") && Catch::Contains("client_state.loss is not a number"));
  const auto tokens = two_rank_checkpoint(root / "tokens", full, [](json& m) {
    m["client_state"] = {{"skipped_steps", 0}, {"tokens_seen", -5}};
  });
  CHECK_THAT(open_error(tokens), Catch::Contains("client_state.tokens_seen"));
  // Fields read elsewhere (an export, a resume) are checked here, where their file is named.
  const std::vector<std::pair<std::function<void(json&)>, std::string>> fields = {
      {[](json& m) { m["model"]["source"] = 5; }, "model.source is not a string"},
      {[](json& m) { m["model"]["lora"] = 5; }, "model.lora names no origin"},
      {[](json& m) { m["model"]["lora"] = {{"origin", "x"}, {"targets", {"q_proj"}}, {"trainable", json::array()},
                                          {"rank", 0}, {"alpha", 1}, {"dropout", 0}}; },
       "model.lora.rank must be an integer in [1, 65536]"},
      {[](json& m) { m["model"]["base"] = 5; }, "model.base names no path"},
      {[](json& m) { m["model"]["base"] = {{"path", "p"}, {"init_seed", -1}}; }, "model.base.init_seed is not an integer >= 0"},
      {[](json& m) { m["scheduler"] = "x"; }, "scheduler is not an object"},
      {[](json& m) { m["scheduler"] = {{"total_steps", "ten"}}; }, "scheduler.total_steps must be an integer"},
      {[](json& m) { m["run"] = 5; }, "run.out_dir is not a string"},
  };
  for (size_t i = 0; i < fields.size(); ++i) {
    const auto forged = two_rank_checkpoint(root / ("field" + std::to_string(i)), full, fields[i].first);
    CHECK_THAT(open_error(forged), Catch::Contains("/metadata.json") && Catch::Contains(fields[i].second));
  }
  const auto foreign = two_rank_checkpoint(root / "foreign", full, [](json& m) { m["format"] = "other"; });
  CHECK_THAT(open_error(foreign), Catch::Contains("foreign/metadata.json"));
  // Still taken for a checkpoint, so that open() says what is wrong rather than the
  // directory passing for an HF one (whose config.json a checkpoint also holds).
  CHECK(ShardedCheckpoint::is_checkpoint(foreign));
}

TEST_CASE("rotation: keeps the newest `keep`, honours the size cap, never deletes the newest", "[checkpoint]") {
  const fs::path root = testing::scratch_dir("rotate");
  remove_tree(root);
  for (int64_t step : {10, 20, 30, 40}) fake_checkpoint(root, step, 1000);
  fs::create_directories(staging_path(root, 50));  // an interrupted save: never listed
  fs::create_directories(root / "step-99999999999999999999");  // past 64 bits: no step's name
  REQUIRE(list_checkpoints(root).size() == 4);
  CHECK(latest_checkpoint(root)->step == 40);

  const auto every = [](const CheckpointEntry&) { return true; };
  CHECK(rotate_checkpoints(root, /*keep=*/3, /*max_bytes=*/0, every).size() == 1);
  CHECK(list_checkpoints(root).front().step == 20);
  CHECK(rotate_checkpoints(root, 0, /*max_bytes=*/2500, every).size() == 1);  // 3000 bytes > 2500: the oldest goes
  CHECK(list_checkpoints(root).front().step == 30);
  CHECK(rotate_checkpoints(root, 0, /*max_bytes=*/1, every).size() == 1);  // even over the cap, the newest stays
  REQUIRE(list_checkpoints(root).size() == 1);
  CHECK(list_checkpoints(root).front().step == 40);
  clear_partial_checkpoints(root);
  CHECK_FALSE(fs::exists(staging_path(root, 50)));
}

TEST_CASE("a step-N that is not a complete checkpoint is refused, not passed over", "[checkpoint]") {
  const fs::path root = testing::scratch_dir("torn");
  remove_tree(root);
  fake_checkpoint(root, 10, 1000);
  fake_checkpoint(root, 20, 1000);
  fs::remove(checkpoint_path(root, 20) / "metadata.json");  // a resume would take step 10
  const auto refusal = [&] {
    try {
      check_complete_checkpoints(root);
    } catch (const UserError& e) {
      return std::string(e.what());
    }
    return std::string("listed");
  };
  CHECK(refusal() == checkpoint_path(root, 20).string() +
                         ": named as a checkpoint, but it holds no metadata.json, so it is not a complete one (a save "
                         "lands whole); move it out of [checkpoint] dir");
  remove_tree(checkpoint_path(root, 20));
  std::ofstream(checkpoint_path(root, 30)) << "notes";
  CHECK_THAT(refusal(), Catch::Contains("step-00000030: named as a checkpoint, but it is not a directory"));
  CHECK(latest_checkpoint(root)->step == 10);  // listing passes over it, as a rotation mid-run must
  fs::remove(checkpoint_path(root, 30));
  CHECK(refusal() == "listed");
}

TEST_CASE("rotation counts and deletes only the checkpoints it is given as its own", "[checkpoint]") {
  const fs::path root = testing::scratch_dir("rotate-shared");
  remove_tree(root);
  // Steps 10 and 30 are another run's, 20, 40 and 50 this one's.
  for (int64_t step : {10, 20, 30, 40, 50}) fake_checkpoint(root, step, 1000);
  const auto ours = [](const CheckpointEntry& c) { return c.step % 20 == 0 || c.step == 50; };
  const auto removed = rotate_checkpoints(root, /*keep=*/1, /*max_bytes=*/0, ours);
  REQUIRE(removed.size() == 2);
  CHECK(removed[0] == checkpoint_path(root, 20));
  CHECK(removed[1] == checkpoint_path(root, 40));
  std::vector<int64_t> left;
  for (const auto& c : list_checkpoints(root)) left.push_back(c.step);
  CHECK(left == std::vector<int64_t>{10, 30, 50});
}

TEST_CASE("HF writer: streams tensors into one file, or shards with an index above the limit", "[checkpoint]") {
  const fs::path root = testing::scratch_dir("hfw");
  ModelConfig config;
  const std::vector<TensorSpec> specs = {{"a", at::kBFloat16, {4, 4}}, {"b", at::kBFloat16, {8}}, {"c", at::kBFloat16, {4, 4}}};
  for (size_t limit : {size_t{1} << 20, size_t{40}}) {
    const fs::path dir = root / std::to_string(limit);
    HfDirWriter writer(config, specs, dir, at::kBFloat16, limit);
    for (const auto& spec : specs) writer.write(spec.name, at::ones(spec.shape, at::kFloat));
    writer.finish();
    const HfWeights weights = HfWeights::open(dir);
    CHECK(weights.names() == std::vector<std::string>{"a", "b", "c"});
    CHECK(fs::exists(dir / "model.safetensors.index.json") == (limit == 40));  // 32 + 16 + 32 bytes > 40
    CHECK(weights.file_of("c").tensor("c").scalar_type() == at::kBFloat16);
  }
  HfDirWriter out_of_order(config, specs, root / "order", at::kBFloat16);
  CHECK_THROWS(out_of_order.write("b", at::ones({8})));
}

TEST_CASE("HF writer: copies the source's tokenizer and processors, and nothing else of it", "[checkpoint]") {
  const fs::path root = testing::scratch_dir("hfw-companions");
  const fs::path source = root / "source";
  fs::create_directories(source);
  const std::vector<std::string> companions = {"tokenizer.json", "preprocessor_config.json",
                                               "video_preprocessor_config.json", "processor_config.json"};
  for (const auto& name : companions) std::ofstream(source / name) << "{\"" << name << "\": 1}";
  std::ofstream(source / "notes.txt") << "mine";
  ModelConfig config;
  const std::vector<TensorSpec> specs = {{"a", at::kFloat, {2}}};
  for (int round = 0; round < 2; ++round) {  // the second replaces the first, processors and all
    HfDirWriter writer(config, specs, root / "out", at::kFloat, size_t{1} << 20, source);
    writer.write("a", at::ones({2}));
    writer.finish();
  }
  for (const auto& name : companions) CHECK(read_text_file(root / "out" / name) == read_text_file(source / name));
  CHECK_FALSE(fs::exists(root / "out" / "notes.txt"));
  CHECK_FALSE(fs::exists(root / "out" / ".fsdpp-export-staging"));  // the staging directory's mark stays behind
}

TEST_CASE("HF writer: a config that names no architectures gets its model's class", "[checkpoint]") {
  const fs::path root = testing::scratch_dir("hfw-architectures");
  const std::string fields = R"("model_type": "llama", "hidden_size": 8, "intermediate_size": 16,
      "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 16)";
  const std::vector<TensorSpec> specs = {{"a", at::kFloat, {2}}};
  auto written = [&](const std::string& text, const std::string& name) {
    HfDirWriter writer(ModelConfig::from_text(text, "config.json"), specs, root / name, at::kFloat);
    writer.write("a", at::ones({2}));
    writer.finish();
    return nlohmann::json::parse(read_text_file(root / name / "config.json")).at("architectures");
  };
  CHECK(written("{" + fields + "}", "unnamed") == nlohmann::json::array({"LlamaForCausalLM"}));
  CHECK(written(R"({"architectures": ["MyLlama"], )" + fields + "}", "named") == nlohmann::json::array({"MyLlama"}));
}

TEST_CASE("HF writer: replaces an earlier export, and refuses a directory holding anything else", "[checkpoint]") {
  const fs::path root = testing::scratch_dir("hfw-target");
  ModelConfig config;
  const std::vector<TensorSpec> specs = {{"a", at::kFloat, {4, 4}}, {"b", at::kFloat, {8}}};
  auto export_into = [&](const fs::path& dir, size_t limit) {
    HfDirWriter writer(config, specs, dir, at::kFloat, limit);
    for (const auto& spec : specs) writer.write(spec.name, at::ones(spec.shape, at::kFloat));
    writer.finish();
  };
  // A sharded export (an index, two shards) and a tokenizer are an export's: replaced whole.
  const fs::path earlier = root / "earlier";
  export_into(earlier, 40);
  std::ofstream(earlier / "tokenizer.json") << "{}";
  export_into(earlier, size_t{1} << 20);
  CHECK(fs::exists(earlier / "model.safetensors"));
  CHECK_FALSE(fs::exists(earlier / "model.safetensors.index.json"));
  CHECK_FALSE(fs::exists(earlier / "tokenizer.json"));
  // A directory named with a trailing slash, made afresh, is the directory of that name.
  export_into(root.string() + "/slashed/", size_t{1} << 20);
  CHECK(fs::exists(root / "slashed" / "model.safetensors"));
  CHECK_FALSE(fs::exists(root / ".partial-"));
  // Anything else stays, and so does the directory: refused before a file is written.
  const fs::path mine = root / "mine";
  fs::create_directories(mine / "sub");
  std::ofstream(mine / "config.json") << "{}";
  CHECK_THROWS_WITH(export_into(mine, size_t{1} << 20),
                    (mine.string() + ": holds 'sub', which an export does not write; an export replaces only an "
                                     "empty directory or an earlier one: choose another directory, or empty this one"));
  CHECK(fs::is_directory(mine / "sub"));
  CHECK(read_text_file(mine / "config.json") == "{}");
  const fs::path file = root / "a-file";
  std::ofstream(file) << "mine";
  CHECK_THROWS_WITH(check_export_target(file), Catch::Contains("is a file"));
  CHECK_THROWS_WITH(export_into(file / "inside", size_t{1} << 20),
                    (file / "inside").string() + ": cannot make the directory it lies in (Not a directory)");
  CHECK(read_text_file(file) == "mine");
  CHECK_FALSE(fs::exists(root / ".partial-mine"));
  CHECK_NOTHROW(check_export_target(root / "missing"));
}
