// Laying out a token file's documents in rows, and assembling a batch of rows.
#include "data/packed_documents.h"

#include "core/error.h"
#include "core/log.h"
#include "loss/next_token_loss.h"

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <filesystem>
#include <map>

namespace fsdpp {

namespace {

int64_t document_begin(const TokenFile& tokens, int64_t d) { return d == 0 ? 0 : tokens.document_end(d - 1); }

// The targets of `piece` the run learns: every one, or those the loss mask marks.
int64_t learned_targets(const TokenFile& tokens, const Piece& piece, TrainOn train_on) {
  const int64_t targets = piece.target_count();
  if (train_on == TrainOn::all || targets == 0) return targets;
  return tokens.mask_slice(piece.begin + 1, targets).sum().item<int64_t>();
}

// Documents [first, last) as pieces of at most seq_len tokens: a document longer than a row
// (seq_len inputs and, as the last target, its token seq_len + 1) cut, truncated or left out.
std::vector<Piece> cut_documents(const TokenFile& tokens, int64_t first, int64_t last, const DataConfig& config) {
  std::vector<Piece> pieces;
  for (int64_t d = first; d < last; ++d) {
    const int64_t begin = document_begin(tokens, d), end = tokens.document_end(d);
    const bool longer = end - begin > config.seq_len + 1;
    if (longer && config.long_documents == LongDocumentRule::drop) continue;
    if (longer && config.long_documents == LongDocumentRule::truncate) {
      pieces.push_back({begin, config.seq_len, begin + config.seq_len + 1});
      continue;
    }
    if (longer && !config.packing) {
      throw UserError(tokens.path().string() + ": document " + std::to_string(d) + " holds " +
                      std::to_string(end - begin) + " tokens, more than a row of seq_len " +
                      std::to_string(config.seq_len) + " + 1 can hold with [data] packing = false; set packing = "
                      "true to cut it into pieces, long_documents = \"truncate\" or \"drop\", or raise seq_len");
    }
    for (int64_t at = begin; at < end; at += config.seq_len) {
      pieces.push_back({at, std::min(config.seq_len, end - at), end});
    }
  }
  return pieces;
}

}  // namespace

std::vector<PackedRow> pack_documents(const TokenFile& tokens, int64_t first, int64_t last,
                                      const DataConfig& config) {
  std::vector<Piece> pieces;
  std::vector<int64_t> learned;
  for (const Piece& piece : cut_documents(tokens, first, last, config)) {
    const int64_t targets = learned_targets(tokens, piece, config.train_on);
    if (targets == 0) continue;  // nothing to learn: a one-token document, a prompt's piece
    pieces.push_back(piece);
    learned.push_back(targets);
  }
  std::vector<size_t> longest_first(pieces.size());
  for (size_t i = 0; i < pieces.size(); ++i) longest_first[i] = i;
  if (config.packing) {
    std::stable_sort(longest_first.begin(), longest_first.end(),
                     [&](size_t a, size_t b) { return pieces[a].length > pieces[b].length; });
  }
  std::vector<PackedRow> rows;
  std::multimap<int64_t, size_t> room;  // free slots -> row, for rows that have any
  for (size_t i : longest_first) {
    const Piece& piece = pieces[i];
    // Best fit: the row with the least room that still holds the piece.
    auto fit = config.packing ? room.lower_bound(piece.length) : room.end();
    size_t row = rows.size();
    int64_t free = config.seq_len;
    if (fit != room.end()) {
      row = fit->second;
      free = fit->first;
      room.erase(fit);
    } else {
      rows.emplace_back();
    }
    rows[row].pieces.push_back(piece);
    rows[row].targets += learned[i];
    if (free > piece.length) room.emplace(free - piece.length, row);
  }
  for (PackedRow& row : rows) {
    std::sort(row.pieces.begin(), row.pieces.end(), [](const Piece& a, const Piece& b) { return a.begin < b.begin; });
  }
  return rows;
}

namespace {

// How many documents train: those ending within the file's first (1 - eval_fraction) of tokens.
int64_t train_document_count(const TokenFile& tokens, const DataConfig& config) {
  const int64_t documents = tokens.documents();
  if (config.eval_fraction <= 0) return documents;
  const int64_t budget = tokens.size() - static_cast<int64_t>(static_cast<double>(tokens.size()) * config.eval_fraction);
  int64_t train = 0;
  while (train < documents && tokens.document_end(train) <= budget) ++train;
  if (train == 0 || train == documents) {
    throw UserError(tokens.path().string() + ": [data] eval_fraction " + std::to_string(config.eval_fraction) +
                    " of " + std::to_string(tokens.size()) + " tokens in " + std::to_string(documents) +
                    " documents holds out " + (train == 0 ? "every" : "no whole") +
                    " document; evaluation holds out whole documents");
  }
  return train;
}

std::vector<PackedRow> training_rows(const TokenFile& tokens, int64_t train_documents, const DataConfig& config) {
  if (config.train_on == TrainOn::completion && !tokens.has_mask()) {
    throw UserError(tokens.path().string() + ": [data] train_on = \"completion\" needs a token file with a loss "
                    "mask (version 2, written by scripts/prepare_data.py)");
  }
  auto rows = pack_documents(tokens, 0, train_documents, config);
  if (rows.empty()) {
    throw UserError(tokens.path().string() + ": the " + std::to_string(train_documents) +
                    " training documents hold no target to learn");
  }
  return rows;
}

}  // namespace

PackedDocuments::PackedDocuments(std::shared_ptr<const TokenFile> tokens, const DataConfig& config)
    : tokens_(std::move(tokens)), config_(config), train_documents_(train_document_count(*tokens_, config)),
      rows_(training_rows(*tokens_, train_documents_, config)),
      held_out_(pack_documents(*tokens_, train_documents_, tokens_->documents(), config)),
      order_(static_cast<int64_t>(rows_.size()), config.seed, config.shuffle) {
  // Found now rather than at the first evaluation, hours into the run.
  if (config.eval_fraction > 0 && held_out_.empty()) {
    throw UserError(concat(tokens_->path().string(), ": [data] eval_fraction ", config.eval_fraction, " holds out ",
                           tokens_->documents() - train_documents_, " document(s) with no target to evaluate"));
  }
  log_info("data: ", train_documents_, " documents in ", rows_.size(), " rows of ", config.seq_len, " tokens (",
           config.packing ? "packed" : "one per row", "), ", 100.0 * padding_share(), "% padding",
           long_documents_text());
}

LongDocuments PackedDocuments::long_documents() const {
  LongDocuments found;
  for (int64_t d = 0; d < train_documents_; ++d) {
    const int64_t length = tokens_->document_end(d) - document_begin(*tokens_, d);
    // A document of seq_len + 1 tokens fits a row: its last token predicts nothing.
    if (length <= config_.seq_len + 1) continue;
    ++found.count;
    found.longest = std::max(found.longest, length);
  }
  return found;
}

std::string PackedDocuments::long_documents_text() const {
  const LongDocuments found = long_documents();
  if (found.count == 0) return "";
  const char* what = " longer than a row, cut into pieces that attend only within themselves";
  if (config_.long_documents == LongDocumentRule::truncate) what = " longer than a row, each truncated to one";
  if (config_.long_documents == LongDocumentRule::drop) what = " longer than a row, left out";
  return concat("; ", found.count, what, " (the longest ", found.longest, " tokens)");
}

double PackedDocuments::padding_share() const {
  int64_t used = 0;
  for (const PackedRow& row : rows_) {
    for (const Piece& piece : row.pieces) used += piece.length;
  }
  return 1.0 - static_cast<double>(used) / static_cast<double>(static_cast<int64_t>(rows_.size()) * config_.seq_len);
}

int64_t PackedDocuments::draw_step(int64_t micro_batches) {
  drawn_.clear();
  int64_t targets = 0;
  for (int64_t i = 0; i < micro_batches * config_.batch_size; ++i) {
    drawn_.push_back(order_.next());
    targets += rows_[static_cast<size_t>(drawn_.back())].targets;
  }
  return std::max<int64_t>(targets, 1);
}

MicroBatch PackedDocuments::rows(int64_t micro, int64_t first, int64_t count) const {
  std::vector<const PackedRow*> picked;
  for (int64_t r = first; r < first + count; ++r) {
    picked.push_back(&rows_[static_cast<size_t>(drawn_[static_cast<size_t>(micro * config_.batch_size + r)])]);
  }
  return assemble(picked);
}

MicroBatch PackedDocuments::assemble(const std::vector<const PackedRow*>& rows) const {
  const int64_t count = static_cast<int64_t>(rows.size()), T = config_.seq_len;
  auto input = at::zeros({count, T}, at::kLong);                  // [rows, T], padding token 0
  auto target = at::full({count, T}, kIgnoredTarget, at::kLong);  // [rows, T]
  std::vector<int64_t> offsets;
  for (int64_t r = 0; r < count; ++r) {
    int64_t at = 0;
    for (const Piece& piece : rows[static_cast<size_t>(r)]->pieces) {
      offsets.push_back(r * T + at);
      input[r].narrow(0, at, piece.length).copy_(tokens_->slice(piece.begin, piece.length));
      const int64_t n = piece.target_count();
      auto next = tokens_->slice(piece.begin + 1, n);  // [n]
      if (config_.train_on == TrainOn::completion) next.masked_fill_(tokens_->mask_slice(piece.begin + 1, n).logical_not(), kIgnoredTarget);
      target[r].narrow(0, at, n).copy_(next);
      at += piece.length;
    }
    if (at < T) offsets.push_back(r * T + at);  // the padding: a document of its own
  }
  offsets.push_back(count * T);
  MicroBatch batch{input, target, {}, {}};
  // Rows of one document each attend causally already, so they go as plain rows.
  if (config_.packing) batch.layout.offsets = at::tensor(offsets, at::kLong);
  return batch;
}

nlohmann::json PackedDocuments::identity() const {
  nlohmann::json id = {{"train", std::filesystem::absolute(config_.train).lexically_normal().string()},
                       {"contents", tokens_->fingerprint()}, {"tokens", tokens_->size()},
                       {"documents", train_documents_}, {"rows", rows_.size()}, {"packing", config_.packing},
                       {"shuffle", config_.shuffle}, {"seq_len", config_.seq_len}, {"seed", config_.seed},
                       {"batch_size", config_.batch_size},
                       {"train_on", config_.train_on == TrainOn::all ? "all" : "completion"}};
  // Named where it is not the default, so that checkpoints from before the rule existed match.
  if (config_.long_documents != LongDocumentRule::split) {
    id["long_documents"] = config_.long_documents == LongDocumentRule::truncate ? "truncate" : "drop";
  }
  return id;
}

EvalResult PackedDocuments::evaluate(CausalLM& model, int64_t max_rows, Comm* group) const {
  // With nothing held out, every document is evaluated: the training rows.
  const auto& held_out = config_.eval_fraction > 0 ? held_out_ : rows_;
  const int64_t rows = max_rows > 0 ? std::min<int64_t>(max_rows, static_cast<int64_t>(held_out.size()))
                                    : static_cast<int64_t>(held_out.size());
  auto batch = [&](int64_t first_row, int64_t count) {
    std::vector<const PackedRow*> picked;
    for (int64_t r = first_row; r < first_row + count; ++r) picked.push_back(&held_out[static_cast<size_t>(r)]);
    return assemble(picked);
  };
  return evaluate_rows(model, rows, config_.batch_size, batch, group, tokens_->path().string());
}

}  // namespace fsdpp
