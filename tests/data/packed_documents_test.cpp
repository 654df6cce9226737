// Rows of documents: best-fit packing that cuts long documents and keeps every target once,
// the batch a row becomes (targets, document offsets, padding), one document per row
// without packing, loss masks, and a held-out split by whole documents.
#include "core/error.h"
#include "data/packed_documents.h"

#include "scratch_dir.h"

#include <catch2/catch.hpp>

#include <fstream>
#include <map>

using namespace fsdpp;
namespace fs = std::filesystem;

namespace {

// Writes a version 2 token file (data/token_header.h) whose token i is i % 100, with a loss
// mask when `mask` is not empty.
std::shared_ptr<const TokenFile> write_documents(const std::string& name, const std::vector<uint64_t>& ends,
                                                 const std::vector<uint8_t>& mask = {}) {
  const auto path = fsdpp::testing::scratch_dir("packed") / name;
  std::string bytes("FSDPTOK\0", 8);
  const uint32_t version = 2, width = 2, flags = mask.empty() ? 0 : 1, zero = 0;
  const uint64_t count = ends.back(), vocab = 100, documents = ends.size();
  for (auto [p, n] : {std::pair<const void*, size_t>{&version, 4}, {&width, 4}, {&count, 8}, {&vocab, 8},
                      {&documents, 8}, {&flags, 4}, {&zero, 4}}) {
    bytes.append(static_cast<const char*>(p), n);
  }
  for (uint64_t i = 0; i < count; ++i) {
    const auto token = static_cast<uint16_t>(i % 100);
    bytes.append(reinterpret_cast<const char*>(&token), 2);
  }
  bytes.append(reinterpret_cast<const char*>(ends.data()), ends.size() * 8);
  bytes.append(reinterpret_cast<const char*>(mask.data()), mask.size());
  std::ofstream(path, std::ios::binary) << bytes;
  return std::make_shared<const TokenFile>(TokenFile::open(path));
}

std::vector<int64_t> lengths(const PackedRow& row) {
  std::vector<int64_t> out;
  for (const Piece& p : row.pieces) out.push_back(p.length);
  return out;
}

}  // namespace

TEST_CASE("best fit, longest first: long documents cut into rows, every target kept once", "[train][data]") {
  // Documents of 7, 3, 5, 2 and 12 tokens in rows of 8: the 12 are cut into 8 and 4.
  auto tokens = write_documents("docs.tok", {7, 10, 15, 17, 29});
  const DataConfig config{.train = "docs.tok", .seq_len = 8, .batch_size = 2};
  const auto rows = pack_documents(*tokens, 0, 5, config);
  REQUIRE(rows.size() == 4);
  CHECK(lengths(rows[0]) == std::vector<int64_t>{8});
  CHECK(lengths(rows[1]) == std::vector<int64_t>{7});
  CHECK(lengths(rows[2]) == std::vector<int64_t>{3, 5});  // file order inside a row
  CHECK(lengths(rows[3]) == std::vector<int64_t>{2, 4});
  // A document of n tokens has n - 1 targets; the piece before a cut predicts across it.
  int64_t targets = 0;
  for (const auto& row : rows) targets += row.targets;
  CHECK(targets == 6 + 2 + 4 + 1 + 11);
  CHECK(rows[0].targets == 8);

  PackedDocuments batches(tokens, {.train = "docs.tok", .seq_len = 8, .batch_size = 4, .shuffle = false});
  CHECK(batches.draw_step(1) == targets);
  CHECK(batches.padding_share() == Approx(3.0 / 32));
  CHECK(batches.long_documents().count == 1);  // the 12
  CHECK(batches.long_documents().longest == 12);
  // 9 tokens fit a row of 8 (the last predicts nothing); 10 do not.
  PackedDocuments edge(write_documents("edge.tok", {9, 19}), {.train = "edge.tok", .seq_len = 8, .batch_size = 1});
  CHECK(edge.long_documents().count == 1);
  CHECK(edge.long_documents().longest == 10);
  const MicroBatch b = batches.rows(0, 2, 2);  // rows [3 + 5], [2 + 4 + padding]
  CHECK(torch::equal(b.layout.offsets, torch::tensor({0, 3, 8, 8 + 2, 8 + 6, 16}, torch::kLong)));
  // Row 2 holds tokens 7..9 (document 1) and 10..14 (document 2).
  CHECK(torch::equal(b.input[0], torch::tensor({7, 8, 9, 10, 11, 12, 13, 14}, torch::kLong)));
  CHECK(torch::equal(b.target[0], torch::tensor({8, 9, -100, 11, 12, 13, 14, -100}, torch::kLong)));
  // Row 3: document 3 (tokens 15, 16), the last piece of document 4 (25..28), padding.
  CHECK(torch::equal(b.input[1], torch::tensor({15, 16, 25, 26, 27, 28, 0, 0}, torch::kLong)));
  CHECK(torch::equal(b.target[1], torch::tensor({16, -100, 26, 27, 28, -100, -100, -100}, torch::kLong)));
  // The first piece of document 4 predicts its token 25, past the cut.
  CHECK(batches.rows(0, 0, 1).target[0][7].item<int64_t>() == 25);
}

TEST_CASE("without packing each document has a padded row, and a longer one is refused", "[train][data]") {
  auto tokens = write_documents("rows.tok", {7, 10, 19});
  DataConfig config{.train = "rows.tok", .seq_len = 8, .batch_size = 3, .shuffle = false, .packing = false};
  // Document 2 holds 9 tokens: 8 inputs and a last target fill a row exactly.
  PackedDocuments batches(tokens, config);
  CHECK(batches.order().size() == 3);
  CHECK(batches.draw_step(1) == 6 + 2 + 8);
  const MicroBatch b = batches.rows(0, 0, 3);
  CHECK(!b.layout.offsets.defined());  // plain causal rows
  CHECK(torch::equal(b.input[1], torch::tensor({7, 8, 9, 0, 0, 0, 0, 0}, torch::kLong)));
  CHECK(torch::equal(b.target[2], torch::tensor({11, 12, 13, 14, 15, 16, 17, 18}, torch::kLong)));
  config.seq_len = 7;
  CHECK_THROWS_WITH(PackedDocuments(tokens, config), Catch::Contains("rows.tok: document 2 holds 9 tokens") &&
                                                         Catch::Contains("packing = true"));
}

TEST_CASE("a document longer than a row is truncated to one, or left out, as long_documents says", "[train][data]") {
  // Documents of 7, 12 and 5 tokens in rows of 8: the 12 is the one longer than a row.
  auto tokens = write_documents("long.tok", {7, 19, 24});
  DataConfig config{.train = "long.tok", .seq_len = 8, .batch_size = 1, .shuffle = false, .packing = false,
                    .long_documents = LongDocumentRule::truncate};
  // Without packing a long document fits its row once truncated: its first 8 inputs, 8 targets.
  PackedDocuments truncated(tokens, config);
  CHECK(truncated.order().size() == 3);
  CHECK(truncated.draw_step(3) == 6 + 8 + 4);
  const MicroBatch b = truncated.rows(0, 1, 1);
  CHECK(torch::equal(b.input[0], torch::tensor({7, 8, 9, 10, 11, 12, 13, 14}, torch::kLong)));
  CHECK(torch::equal(b.target[0], torch::tensor({8, 9, 10, 11, 12, 13, 14, 15}, torch::kLong)));
  config.long_documents = LongDocumentRule::drop;
  PackedDocuments dropped(tokens, config);
  CHECK(dropped.order().size() == 2);
  CHECK(dropped.draw_step(2) == 6 + 4);
  CHECK(dropped.long_documents().count == 1);
  // Packed, truncation keeps one piece of the long document where splitting keeps two.
  config.packing = true;
  config.long_documents = LongDocumentRule::truncate;
  int64_t pieces = 0;
  for (const auto& row : pack_documents(*tokens, 0, 3, config)) pieces += static_cast<int64_t>(row.pieces.size());
  CHECK(pieces == 3);
  config.long_documents = LongDocumentRule::split;
  pieces = 0;
  for (const auto& row : pack_documents(*tokens, 0, 3, config)) pieces += static_cast<int64_t>(row.pieces.size());
  CHECK(pieces == 4);
}

TEST_CASE("a loss mask keeps the marked targets and drops rows with none", "[train][data]") {
  // Document 0: a prompt of 4 tokens, then 3 marked; document 1 has no marked token at all.
  auto tokens = write_documents("masked.tok", {7, 12}, {0, 0, 0, 0, 1, 1, 1, 0, 0, 0, 0, 0});
  PackedDocuments batches(tokens, {.train = "masked.tok", .seq_len = 8, .batch_size = 1, .shuffle = false,
                                   .train_on = TrainOn::completion});
  CHECK(batches.order().size() == 1);
  CHECK(batches.draw_step(1) == 3);
  CHECK(torch::equal(batches.rows(0, 0, 1).target[0], torch::tensor({-100, -100, -100, 4, 5, 6, -100, -100}, torch::kLong)));
  auto unmasked = write_documents("unmasked.tok", {7, 12});
  CHECK_THROWS_WITH(PackedDocuments(unmasked, {.train = "unmasked.tok", .train_on = TrainOn::completion}),
                    Catch::Contains("needs a token file with a loss mask"));
}

TEST_CASE("evaluation holds out whole documents", "[train][data]") {
  auto tokens = write_documents("split.tok", {40, 70, 90, 100});
  // 10% of 100 tokens rounds to the last document alone; 25% to the last two.
  for (auto [fraction, held_out] : {std::pair{0.1, 1}, {0.25, 2}}) {
    PackedDocuments batches(tokens, {.train = "split.tok", .seq_len = 64, .batch_size = 1, .eval_fraction = fraction});
    CHECK(batches.identity()["documents"] == 4 - held_out);
  }
  CHECK_THROWS_WITH(PackedDocuments(tokens, {.train = "split.tok", .eval_fraction = 0.005}),
                    Catch::Contains("split.tok") && Catch::Contains("holds out no whole document"));
  CHECK_THROWS_WITH(PackedDocuments(tokens, {.train = "split.tok", .eval_fraction = 0.7}),
                    Catch::Contains("holds out every document"));
}
