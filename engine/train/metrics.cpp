// Metric records: log lines, progress bar, JSONL.
#include "train/metrics.h"

#include "core/error.h"
#include "core/log.h"
#include "core/config_file.h"

#include <nlohmann/json.hpp>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iomanip>

namespace fsdpp {

namespace {

// JSON has no NaN or infinity; a skipped step's norm is written as null.
nlohmann::json number(double v) { return std::isfinite(v) ? nlohmann::json(v) : nlohmann::json(); }

}  // namespace

MetricsConfig MetricsConfig::from_section(ConfigSection& s) {
  MetricsConfig c;
  c.jsonl = s.get_string("jsonl", c.jsonl);
  c.progress = s.get_string("progress", c.progress);
  c.profile_step = s.get_int("profile_step", c.profile_step, 0, kMaxSteps);  // 0: off
  s.finish();
  if (c.progress != "auto" && c.progress != "always" && c.progress != "never") {
    s.fail("progress", "'" + c.progress + "' is not one of auto, always, never");
  }
  return c;
}

MetricsSink::MetricsSink(const MetricsConfig& config, const std::string& jsonl_path, int64_t total_steps,
                         int64_t resumed_after)
    : total_steps_(total_steps),
      progress_(config.progress == "always" || (config.progress == "auto" && ::isatty(STDERR_FILENO))) {
  const auto parent = std::filesystem::path(jsonl_path).parent_path();
  if (!parent.empty()) std::filesystem::create_directories(parent);
  // A resumed run keeps the records up to its checkpoint and drops those of steps it redoes.
  std::string kept;
  if (resumed_after > 0) {
    std::ifstream old(jsonl_path);
    for (std::string line; std::getline(old, line);) {
      const auto j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
      if (j.is_object() && j.value("step", int64_t{0}) <= resumed_after) kept += line + "\n";
    }
  }
  jsonl_.open(jsonl_path, std::ios::trunc);
  jsonl_ << kept;
  if (!jsonl_) throw UserError(jsonl_path + ": cannot write metrics");
}

MetricsSink::~MetricsSink() { clear_progress(); }

void MetricsSink::record_step(const StepMetrics& m, bool log_line) {
  nlohmann::json j = {{"step", m.step},       {"loss", number(m.loss)},
                      {"lr", m.lr},           {"grad_norm", number(m.grad_norm)},
                      {"tokens_per_s", m.tokens_per_s}, {"elapsed_s", m.elapsed_s},
                      {"tokens", m.tokens}};
  if (m.skipped) j["skipped"] = true;
  jsonl_ << j.dump() << '\n' << std::flush;
  if (log_line) {
    clear_progress();
    std::ostringstream line;
    line << std::fixed << "step " << m.step << "/" << total_steps_ << "  loss "
         << std::setprecision(4) << m.loss << "  lr " << std::scientific << std::setprecision(3)
         << m.lr << std::fixed << "  grad_norm " << std::setprecision(3) << m.grad_norm
         << "  tok/s " << std::setprecision(0) << m.tokens_per_s << "  elapsed "
         << std::setprecision(1) << m.elapsed_s << "s";
    log_info(line.str());
  }
  if (progress_) draw_progress(m);
}

void MetricsSink::record_eval(int64_t step, double loss, double perplexity) {
  jsonl_ << nlohmann::json{{"step", step}, {"eval_loss", loss}, {"eval_perplexity", perplexity}}.dump()
         << '\n' << std::flush;
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
