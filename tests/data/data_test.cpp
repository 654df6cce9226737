// Token files and batches: header checks, deterministic shuffled windows covering each
// epoch once, and learning-rate schedule shapes.
#include "core/error.h"
#include "data/data.h"
#include "data/token_header.h"
#include "optim/lr_schedule.h"
#include "scratch_dir.h"

#include <catch2/catch.hpp>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <numbers>
#include <set>

using namespace fsdpp;
namespace fs = std::filesystem;

namespace {

// Writes a version 1 token file (data/token_header.h).
fs::path write_tokens(const std::vector<uint16_t>& tokens, int64_t drop_bytes = 0) {
  auto path = testing::scratch_dir("tok") / (std::to_string(tokens.size()) + "-" + std::to_string(drop_bytes) + ".tok");
  std::string bytes("FSDPTOK\0", 8);
  uint32_t version = 1, width = 2;
  uint64_t count = tokens.size(), vocab = 65536;
  for (auto [p, n] : {std::pair<const void*, size_t>{&version, 4}, {&width, 4}, {&count, 8}, {&vocab, 8}}) {
    bytes.append(static_cast<const char*>(p), n);
  }
  bytes.append(reinterpret_cast<const char*>(tokens.data()), tokens.size() * 2);
  bytes.resize(bytes.size() - drop_bytes);
  std::ofstream(path, std::ios::binary) << bytes;
  return path;
}

// A version 2 file's bytes: tokens, document ends and, with flags 1, one mask byte per token.
std::string v2_bytes(const std::vector<uint16_t>& tokens, const std::vector<uint64_t>& ends,
                     const std::vector<uint8_t>& mask, uint32_t flags = 1) {
  std::string bytes("FSDPTOK\0", 8);
  const uint32_t version = 2, width = 2, zero = 0;
  const uint64_t count = tokens.size(), vocab = 100, documents = ends.size();
  for (auto [p, n] : {std::pair<const void*, size_t>{&version, 4}, {&width, 4}, {&count, 8}, {&vocab, 8},
                      {&documents, 8}, {&flags, 4}, {&zero, 4}}) {
    bytes.append(static_cast<const char*>(p), n);
  }
  bytes.append(reinterpret_cast<const char*>(tokens.data()), tokens.size() * 2);
  bytes.append(reinterpret_cast<const char*>(ends.data()), ends.size() * 8);
  bytes.append(reinterpret_cast<const char*>(mask.data()), mask.size());
  return bytes;
}

std::string v2_error(const std::string& bytes) {
  try {
    TokenHeader::parse(reinterpret_cast<const std::byte*>(bytes.data()), bytes.size(), "chat.tok");
  } catch (const UserError& e) {
    return e.what();
  }
  return "";
}

std::vector<uint16_t> iota_tokens(size_t n) {
  std::vector<uint16_t> t(n);
  for (size_t i = 0; i < n; ++i) t[i] = static_cast<uint16_t>(i);
  return t;
}

}  // namespace

TEST_CASE("token files read back and refuse truncation", "[train][data]") {
  auto tokens = TokenFile::open(write_tokens(iota_tokens(300)));
  CHECK(tokens.size() == 300);
  CHECK(tokens.vocab_size() == 65536);
  CHECK(torch::equal(tokens.slice(10, 3), torch::tensor({10, 11, 12}, torch::kLong)));
  auto truncated = write_tokens(iota_tokens(300), 5);
  CHECK_THROWS_WITH(TokenFile::open(truncated),
                    Catch::Contains(truncated.string()) && Catch::Contains("truncated"));
}

TEST_CASE("version 2 token files: document ends and a loss mask, each checked", "[train][data]") {
  const std::vector<uint16_t> tokens = {5, 6, 7, 8, 9};
  const std::string good = v2_bytes(tokens, {2, 5}, {0, 1, 0, 1, 1});
  const TokenHeader h = TokenHeader::parse(reinterpret_cast<const std::byte*>(good.data()), good.size(), "chat.tok");
  CHECK((h.version == 2 && h.count == 5 && h.documents == 2 && h.has_mask));
  CHECK(v2_error(v2_bytes(tokens, {2, 5}, {}, 0)).empty());  // no mask
  CHECK_THAT(v2_error(v2_bytes(tokens, {3, 2, 5}, {0, 1, 0, 1, 1})), Catch::Contains("document 1 ends at token 2"));
  CHECK_THAT(v2_error(v2_bytes(tokens, {2, 4}, {0, 1, 0, 1, 1})), Catch::Contains("document 1 ends at token 4"));
  CHECK_THAT(v2_error(v2_bytes(tokens, {2, 5}, {0, 1, 2, 1, 1})), Catch::Contains("mask byte of token 2 is 2"));
  CHECK_THAT(v2_error(v2_bytes(tokens, {2, 5}, {0, 1, 0, 1, 1}, 3)), Catch::Contains("unknown header flags 3"));
  CHECK_THAT(v2_error(good + "x"), Catch::Contains("truncated or padded"));
  CHECK_THAT(v2_error(v2_bytes(tokens, {}, {0, 1, 0, 1, 1})), Catch::Contains("no document ends"));
}

TEST_CASE("batches are shifted windows, each window once per epoch, reproducible", "[train][data]") {
  auto tokens = std::make_shared<const TokenFile>(TokenFile::open(write_tokens(iota_tokens(1000))));
  const int64_t seq = 9;
  // The last 10% (100 tokens) is held out: windows come from tokens [0, 900).
  const DataConfig config{.train = "tokens", .seq_len = seq, .batch_size = 4, .eval_fraction = 0.1, .seed = 5};
  TokenWindows a(tokens, config), b(tokens, config), c(tokens, DataConfig{config.train, seq, 4, 0.1, /*seed=*/6});
  const int64_t windows = a.order().size();
  CHECK(windows == (900 - 1) / seq);
  // Tokens equal their positions, so a window's first token is its start.
  std::set<int64_t> starts;
  bool differs = false;
  for (int64_t i = 0; i < windows / 4; ++i) {
    for (auto* w : {&a, &b, &c}) CHECK(w->draw_step(1) == 4 * seq);
    // Two ranks' rows of the batch are the rows of the whole batch.
    const MicroBatch x = a.rows(0, 0, 4), y = b.rows(0, 0, 4), z = c.rows(0, 0, 4), x_hi = a.rows(0, 2, 2);
    CHECK(torch::equal(x.input, y.input));
    CHECK(torch::equal(x.input.narrow(0, 2, 2), x_hi.input));
    differs |= !torch::equal(x.input, z.input);
    REQUIRE(x.input.sizes() == torch::IntArrayRef({4, seq}));
    CHECK(torch::equal(x.target, x.input + 1));
    for (int64_t r = 0; r < 4; ++r) {
      const int64_t start = x.input[r][0].item<int64_t>();
      CHECK(start % seq == 0);
      CHECK(start + seq < 900);
      CHECK(starts.insert(start).second);  // no window twice within an epoch
    }
  }
  CHECK(differs);
}

TEST_CASE("warmup then cosine, linear or constant", "[train][schedule]") {
  ScheduleConfig config{.kind = Decay::cosine, .warmup_steps = 10, .min_lr_ratio = 0.1};
  LrSchedule cosine(config, 1.0, 110);
  CHECK(cosine.at(1) == Approx(0.1));
  CHECK(cosine.at(10) == Approx(1.0));
  CHECK(cosine.at(11) == Approx(1.0));
  CHECK(cosine.at(61) == Approx(0.55));
  CHECK(cosine.at(110) == Approx(0.1 + 0.9 * 0.5 * (1 + std::cos(std::numbers::pi * 99 / 100))));
  CHECK(cosine.at(111) == Approx(0.1));  // past the end: the minimum
  config.kind = Decay::linear;
  CHECK(LrSchedule(config, 1.0, 110).at(61) == Approx(0.55));
  CHECK(LrSchedule(config, 1.0, 110).at(36) == Approx(1.0 - 0.9 * 0.25));
  // One step with no warmup trains at the peak, not at min_lr.
  CHECK(LrSchedule({.kind = Decay::cosine}, 1.0, 1).at(1) == Approx(1.0));
  config.kind = Decay::constant;
  CHECK(LrSchedule(config, 2.0, 110).at(80) == Approx(2.0));
}
