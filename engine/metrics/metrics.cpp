// Metric records: log lines, progress bar, JSONL, TensorBoard.
#include "metrics/metrics.h"

#include "core/error.h"
#include "core/log.h"
#include "metrics/tensorboard.h"

#include <nlohmann/json.hpp>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iomanip>

namespace fsdpp {

namespace {

// JSON has no NaN or infinity; a skipped step's norm is written as null.
nlohmann::json number(double v) { return std::isfinite(v) ? nlohmann::json(v) : nlohmann::json(); }

}  // namespace

std::vector<std::pair<std::string, double>> StepMetrics::figures() const {
  std::vector<std::pair<std::string, double>> f = {
      {"loss", loss}, {"lr", lr}, {"grad_norm", grad_norm}, {"tokens_per_s", tokens_per_s},
      {"elapsed_s", elapsed_s}, {"tokens", static_cast<double>(tokens)}, {"targets", static_cast<double>(targets)},
      {"eta_s", eta_s},
      {"host_peak_gb", host_peak_gb}};
  for (const auto& [key, value] : {std::pair{"mfu", mfu}, {"device_allocated_gb", device_allocated_gb},
                                   {"device_reserved_gb", device_reserved_gb}, {"aux_loss", aux_loss},
                                   {"expert_load", expert_load}, {"loss_scale", loss_scale}}) {
    if (value) f.emplace_back(key, *value);
  }
  return f;
}

MetricsSink::MetricsSink(const MetricsConfig& config, int64_t total_steps, int64_t resumed_after)
    : jsonl_path_(config.jsonl),
      tensorboard_(std::make_unique<TensorBoardWriter>(config.tensorboard, resumed_after)),
      total_steps_(total_steps),
      progress_(config.progress == Progress::always ||
                (config.progress == Progress::on_terminal && ::isatty(STDERR_FILENO))) {
  const std::string& jsonl_path = jsonl_path_;
  const auto parent = std::filesystem::path(jsonl_path).parent_path();
  if (!parent.empty()) std::filesystem::create_directories(parent);
  // A resumed run keeps the records up to its checkpoint and drops those of steps it redoes,
  // as its TensorBoard session start makes TensorBoard do. A pipe or a device has no records
  // to keep, and reading one would wait for a writer.
  std::string kept;
  if (resumed_after > 0 && std::filesystem::is_regular_file(jsonl_path)) {
    std::ifstream old(jsonl_path);
    for (std::string line; std::getline(old, line);) {
      const auto j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
      if (j.is_object() && j.value("step", int64_t{0}) <= resumed_after) kept += line + "\n";
    }
  }
  jsonl_.open(jsonl_path, std::ios::trunc);
  if (!jsonl_) throw UserError("[metrics] jsonl: " + jsonl_path + ": cannot write metrics");
  write_record(kept);
}

void MetricsSink::write_record(const std::string& line) {
  errno = 0;
  jsonl_ << line << std::flush;
  // A run whose records are lost (a full disk, /dev/full) stops at the first, as a failed
  // TensorBoard write does, rather than train on with no figures to show for it.
  if (!jsonl_) {
    throw UserError("[metrics] jsonl: " + jsonl_path_ + ": cannot write metrics" +
                    (errno != 0 ? std::string(": ") + std::strerror(errno) : std::string()));
  }
}

MetricsSink::~MetricsSink() { clear_progress(); }

void MetricsSink::record_step(const StepMetrics& m, bool log_line) {
  nlohmann::json j = {{"step", m.step}};
  std::vector<std::pair<std::string, double>> scalars;
  for (const auto& [key, value] : m.figures()) {
    if (key == "tokens" || key == "targets") {
      j[key] = key == "tokens" ? m.tokens : m.targets;
    } else {
      j[key] = number(value);
    }
    if (std::isfinite(value)) scalars.emplace_back(key, value);  // JSON null: no scalar
  }
  if (m.skipped) j["skipped"] = true;
  write_record(j.dump() + '\n');
  tensorboard_->add_scalars(m.step, scalars);
  if (log_line) {
    clear_progress();
    log_info(step_line(m));
  }
  if (progress_) draw_progress(m);
}

std::string MetricsSink::step_line(const StepMetrics& m) const {
  std::ostringstream line;
  line << std::fixed << "step " << m.step << "/" << total_steps_ << "  loss " << std::setprecision(4) << m.loss
       << "  lr " << std::scientific << std::setprecision(3) << m.lr << std::fixed << "  grad_norm "
       << std::setprecision(3) << m.grad_norm << "  tok/s " << std::setprecision(0) << m.tokens_per_s;
  if (m.mfu) line << "  mfu " << std::setprecision(1) << 100 * *m.mfu << "%";
  if (m.aux_loss) line << "  aux " << std::setprecision(4) << *m.aux_loss;
  if (m.expert_load) line << "  load " << std::setprecision(2) << *m.expert_load;
  line << "  mem " << std::setprecision(2) << m.host_peak_gb << " GB";
  if (m.device_allocated_gb) {
    line << " (device " << *m.device_allocated_gb << " allocated, " << *m.device_reserved_gb << " reserved)";
  }
  line << "  elapsed " << std::setprecision(1) << m.elapsed_s << "s  left " << m.eta_s << "s";
  return line.str();
}

void MetricsSink::record_eval(int64_t step, double loss, double perplexity) {
  write_record(nlohmann::json{{"step", step}, {"eval_loss", loss}, {"eval_perplexity", perplexity}}.dump() + '\n');
  tensorboard_->add_scalars(step, {{"eval_loss", loss}, {"eval_perplexity", perplexity}});
  clear_progress();
  log_info("eval at step ", step, ": loss ", loss, "  perplexity ", perplexity);
}

void MetricsSink::draw_progress(const StepMetrics& m) {
  constexpr int kWidth = 30;
  const int filled = static_cast<int>(kWidth * m.step / std::max<int64_t>(1, total_steps_));
  std::fprintf(stderr, "\r[%s%s] %lld/%lld loss %.4f  %.0f tok/s ", std::string(filled, '#').c_str(),
               std::string(kWidth - filled, '.').c_str(), static_cast<long long>(m.step),
               static_cast<long long>(total_steps_), m.loss, m.tokens_per_s);
  std::fflush(stderr);
  bar_drawn_ = true;
}

void MetricsSink::clear_progress() {
  if (!bar_drawn_) return;
  std::fprintf(stderr, "\r\033[K");
  std::fflush(stderr);
  bar_drawn_ = false;
}

}  // namespace fsdpp
