// A Run driven from Python, one rank per process, for loops that bring their own rows and loss
// (RL: log-probabilities, ratios, KL): the run the binary builds, from the same run file and
// policies. module.cpp gives it to Python as _fsdpp.Run; the package fsdpp (fsdpp/*.py) is its Python face.
// Every call releases the GIL and holds the run alone (exclusively); at world > 1 a call's
// inputs are agreed over the ranks before its first collective, so that one rank's refusal is
// every rank's and the run goes on in step.
#pragma once

#include "core/error.h"
#include "optim/lr_schedule.h"
#include "run/run.h"

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace fsdpp {

// How gradients summed over the ranks become the step's: averaged (as DDP and FSDP2 do) or
// left summed.
enum class GradReduction { mean, sum };
GradReduction grad_reduction_named(const std::string& name);

// A forward's images and videos by transformers' names (pixel_values, image_grid_thw,
// pixel_values_videos, video_grid_thw, second_per_grid_ts, mm_token_type_ids; checked_vision
// in inputs.h).
using VisionArguments = std::map<std::string, at::Tensor>;
// Where each of a generation's options came from, for its messages: an option's name
// ("temperature", "eos_token_id", ...) -> the argument's name, or a file's path and key.
using OptionNames = std::map<std::string, std::string>;

class PythonRun {
 public:
  // The run of the file at `path` with `overrides` ("key=value", as --set gives them); a frozen
  // one (Run's RunWeights::frozen) is an RL loop's reference model, and reads no [checkpoint].
  PythonRun(const std::string& path, const std::vector<std::string>& overrides, const std::string& grad_reduction,
            bool frozen);

  // Logits [B, T, V] of input_ids [B, T] int64 (RoPE positions from `position_ids` [B, T];
  // documents packed into the rows from `document_offsets` [S + 1], offsets into the rows
  // read one after another; a vision-language model's images and videos from `vision`).
  at::Tensor forward(const at::Tensor& input_ids, const std::optional<at::Tensor>& position_ids,
                     const std::optional<at::Tensor>& document_offsets, const VisionArguments& vision);
  // The final hidden states [B, T, C] of input_ids (Run::hidden_states), positions, documents
  // and images as forward takes them.
  at::Tensor hidden_states(const at::Tensor& input_ids, const std::optional<at::Tensor>& position_ids,
                           const std::optional<at::Tensor>& document_offsets, const VisionArguments& vision);
  // Per-token log-probabilities [B, T] of targets [B, T] (the token each position predicts)
  // at `temperature`, chunked: no [B, T, V] logits are held (Run::logprobs); with `entropy`,
  // each token's entropy [B, T] after them.
  std::vector<at::Tensor> logprobs(const at::Tensor& input_ids, const at::Tensor& targets, double temperature,
                                   const std::optional<at::Tensor>& position_ids,
                                   const std::optional<at::Tensor>& document_offsets, const VisionArguments& vision,
                                   bool entropy);
  // Each row of input_ids [B, T] int64, padded on the left where `attention_mask` [B, T] says
  // (0: padding), with `vision` as forward takes it, continued as Run::generate does:
  // [B, T + added] int64.
  // `names` tells where each option came from, for its messages.
  at::Tensor generate(const at::Tensor& input_ids, const std::optional<at::Tensor>& attention_mask,
                      const VisionArguments& vision, const GenerationOptions& options, const OptionNames& names);
  // Where the package refused this rank's arguments to `call` before they reached the run:
  // tells the other ranks, as agree_on_inputs does, and returns for the package to raise its
  // own error.
  void refuse_inputs(const std::string& call);
  // One optimizer step from the gradients the backward calls since zero_grad left, at `lr`
  // (the same on every rank; none: the [scheduler]'s rate for this step, scheduled_lr()):
  // (global gradient norm before clipping, whether the update was applied).
  std::pair<double, bool> step(std::optional<double> lr);
  double scheduled_lr() const;
  // Unit `unit`'s weights gathered whole in `dtype` ("bfloat16", ...), LoRA merged.
  std::vector<std::pair<std::string, at::Tensor>> full_weights(int64_t unit, const std::string& dtype);
  // Replaces the named parameters with the full tensors given (Run::load_weights), checked
  // over the ranks first, so that a refusal is every rank's and changes nothing; the ranks'
  // names, dtypes and shapes must agree. No pairs: the end of the caller's pairs, agreed too;
  // returns false there, else true.
  bool load_weights(const std::vector<std::pair<std::string, at::Tensor>>& weights);
  // Saves the run at its step count as the binary saves it: a sharded checkpoint under `root`
  // (none: [checkpoint] dir; older ones rotated by keep and max_gb) that `fsdpp train` and
  // `fsdpp export` read, and that load() or [checkpoint] resume brings back at any world size.
  // Returns its path, as bytes for the module to hand over: a name of no UTF-8 is the caller's
  // to decode. `loop_state` (JSON text, "" for none) is this rank's state of the caller's loop,
  // kept in the checkpoint beside the run's.
  std::string save(const std::optional<std::string>& root, const std::string& loop_state);
  // Replaces the parameters, the optimizer's state and the step count with the checkpoint's.
  void load(const std::string& path);
  // The loop state (JSON text; "" for none) of the checkpoint the run last resumed from or
  // loaded: this rank's, or rank r % the saved world's.
  const std::string& loop_state() const { return loop_state_; }
  // Moves the named state ("params", "grads", "optimizer") off the device until reload().
  void offload(const std::vector<std::string>& what);
  void reload();
  void zero_grad();
  // Whether the model's forwards train (LoRA's dropout on) or only compute (off), as a torch
  // module's train() and eval() say: a loop samples and takes reference log-probabilities in
  // eval(), so that a PPO ratio starts at 1.
  void set_training(bool training);
  bool training() { return run_->model().is_training(); }
  bool frozen() const { return run_->frozen(); }
  int64_t units() const { return static_cast<int64_t>(run_->units()); }
  int rank() { return run_->comm().rank(); }
  int world_size() const { return run_->comm().size(); }
  int64_t steps() const { return steps_; }
  // Counts the changes of the weights (steps applied, loads): an iteration of full_weights
  // that sees it move would hand out units of two states.
  int64_t weights_version() const { return weights_version_; }
  std::optional<double> loss_scale() const { return run_->loss_scale(); }
  std::string device() const { return run_->device().str(); }
  int64_t vocab_size() const { return run_->model().config().vocab_size; }
  int64_t hidden_size() const { return run_->model().config().hidden_size; }
  std::string model_dir() const { return run_->model_files().string(); }

 private:
  // `work` on the run with the GIL released, so that the loop's other Python threads go on
  // meanwhile, and one call at a time: a second thread's call, or a backward another thread
  // begins, waits for the first to end, and a call waits for a backward another thread runs
  // (Run::begin_call). One that ended in an exception is put right (FsdpState::settle_backward).
  // Past an error of this rank's alone, a rank of a larger world is out of step with the others
  // (they wait in collectives it left, or would meet its next ones with theirs): its run
  // refuses every later call, naming that error, rather than pair collectives that differ.
  template <typename Work>
  std::invoke_result_t<Work&> exclusively(Work&& work);
  void fall_out_of_step(const std::string& error);
  // forward's logits, or with `hidden` the final hidden states, as `call` of the package.
  at::Tensor model_output(const std::string& call, bool hidden, const at::Tensor& input_ids,
                          const std::optional<at::Tensor>& position_ids,
                          const std::optional<at::Tensor>& document_offsets, const VisionArguments& vision);
  // `check` of a call's inputs, agreed over the ranks before the call's first collective: an
  // input is a rank's own (its rows), and a rank that raised alone would leave the others in
  // collectives it never joins. Where any rank's check failed, every rank raises.
  template <typename Check>
  void agree_on_inputs(const std::string& call, Check&& check);
  // Where another rank refused its inputs to `call`, or is in another call (a loop that calls
  // the ranks' runs in different orders), EveryRankError naming it; otherwise returns, for this
  // rank to go on or raise its own error.
  void agree_on_refusal(const std::string& call, bool refused_here);
  // Raises on every rank where a rank's rate for step() is out of range or differs from the
  // others' (a rate on one rank and none on another included).
  void agree_on_rate(std::optional<double> lr);

  RunConfig config_;
  GradReduction reduction_;
  LrSchedule schedule_;
  std::unique_ptr<Run> run_;
  int64_t steps_ = 0;  // optimizer steps applied, resumed ones included
  int64_t skipped_steps_ = 0;  // updates skipped for a gradient norm that was not finite
  std::string loop_state_;     // what the last resume or load brought of the caller's loop
  int64_t weights_version_ = 0;
  std::optional<std::string> out_of_step_;  // why this rank left the others' collectives, once it has
};

}  // namespace fsdpp
