// A token file's documents (version 2) as training rows of seq_len tokens. With packing,
// several documents share a row and attention never crosses from one into another
// (models/document_attention.h); a document longer than a row is cut into pieces of seq_len
// tokens, each predicting the next token of its document even across the cut, or truncated
// to its first row, or left out ([data] long_documents). Without packing, each document has a
// row of its own, padded, and one that does not fit is refused unless truncated or left out.
// Rows are laid out once for the run, so every epoch visits the same rows in an order the
// seed fixes, at any world size, and a resume continues the exact sequence. Evaluation holds
// out whole documents: the file's last eval_fraction of tokens, rounded to document ends.
#pragma once

#include "data/batches.h"
#include "data/data.h"

#include <memory>
#include <vector>

namespace fsdpp {

// Tokens [begin, begin + length) of the file in one row, each predicting the next token of
// its document (the document's last token predicts nothing).
struct Piece {
  int64_t begin = 0, length = 0, document_end = 0;
  int64_t target_count() const { return std::min(length, document_end - begin - 1); }
};

struct PackedRow {
  std::vector<Piece> pieces;  // in file order
  int64_t targets = 0;        // tokens the run learns: every target, or the marked ones
};

// Lays out documents [first, last) of `tokens` in rows of `seq_len` (packed: best fit, the
// longest pieces first). Pieces without a target the run learns are left out.
std::vector<PackedRow> pack_documents(const TokenFile& tokens, int64_t first, int64_t last,
                                      const DataConfig& config);

// The training documents longer than a row, which packing cuts into pieces (unless truncated or
// left out): a piece after a cut attends to none of its document's tokens before it, which a
// long chat's user should know.
struct LongDocuments {
  int64_t count = 0, longest = 0;  // longest: tokens of the longest of them
};

class PackedDocuments : public Batches {
 public:
  PackedDocuments(std::shared_ptr<const TokenFile> tokens, const DataConfig& config);

  int64_t draw_step(int64_t micro_batches) override;
  MicroBatch rows(int64_t micro, int64_t first, int64_t count) const override;
  ShuffledOrder& order() override { return order_; }
  nlohmann::json identity() const override;
  const char* item_name() const override { return "rows"; }
  bool can_evaluate() const override { return config_.eval_fraction > 0; }
  EvalResult evaluate(CausalLM& model, int64_t max_rows, Comm* group) const override;

  // The share of the training rows' slots that hold no document (for the log and benchmarks).
  double padding_share() const;
  LongDocuments long_documents() const;

 private:
  MicroBatch assemble(const std::vector<const PackedRow*>& rows) const;
  std::string long_documents_text() const;  // the log's clause on long_documents(), empty without any

  std::shared_ptr<const TokenFile> tokens_;
  DataConfig config_;
  int64_t train_documents_ = 0;  // documents [0, train_documents_) train, the rest are held out
  std::vector<PackedRow> rows_;
  std::vector<PackedRow> held_out_;  // the held-out documents' rows (none when nothing is held out)
  ShuffledOrder order_;
  std::vector<int64_t> drawn_;  // the step's rows, micro-batch after micro-batch
};

}  // namespace fsdpp
