// One training run on this rank, as one object. Its constructor builds the run in the order
// each piece needs the one before: the rendezvous, the checkpoint to resume from, the data,
// the policy's plan over a skeleton of the model, the weights, the shards, the optimizer.
// resume() then restores that checkpoint (run/run_restore.cpp), step() trains one optimizer
// step, and save() and export_final() write what a run leaves behind
// (run/run_checkpoint.cpp). The training loop (run/train_loop.h) drives it; a plain process
// is a world of one and builds the same run.
#pragma once

#include "data/batches.h"
#include "distributed/comm.h"
#include "fsdp/sharded_view.h"
#include "io/hf_dir.h"
#include "io/model_source.h"
#include "loss/chunked_logprobs.h"
#include "loss/expert_balance.h"
#include "optim/adamw.h"
#include "run/run_config.h"
#include "run/sampling.h"

#include <nlohmann/json_fwd.hpp>

#include <chrono>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace torch::autograd {
struct Node;
}

namespace fsdpp {

class FsdpState;
class OutDirLock;
class ShardedCheckpoint;

// Builds the wrap plan for the model at (world, rank): the policy, in the binary.
using PlanBuilder = std::function<Plan(CausalLM& model, int world, int rank)>;

// What a checkpoint keeps of the loop besides the model, the optimizer and the data position.
struct ClientState {
  int64_t skipped_steps = 0;  // updates skipped for a gradient norm that was not finite
  int64_t tokens_seen = 0;
  double loss = 0.0;          // the step's
};
// Its one writer and one reader, as checkpoint metadata holds it.
void to_json(nlohmann::json& j, const ClientState& state);
void from_json(const nlohmann::json& j, ClientState& state);

// Where a resumed run stands: the last step its checkpoint completed (0 when fresh).
struct ResumePoint {
  int64_t step = 0;
  ClientState state;
  // This rank's state of a caller's own loop (JSON text, Run::save's `loop_state`); "" where
  // none was saved.
  std::string loop_state;
};

// What applying the caller's gradients did (Run::apply_gradients), the same on every rank.
struct UpdateFigures {
  double grad_norm = 0.0;  // global, after the division and before clipping
  bool stepped = false;    // false: the norm was not finite and the update was skipped
};

// A step's figures, the same on every rank.
struct StepFigures {
  double loss = 0.0;       // the mean over the step's targets on every rank
  double grad_norm = 0.0;  // global, before clipping; not finite: the update was skipped
  int64_t targets = 0;     // the tokens the loss was over, on every rank: no padding, no masked prompt
  bool stopping = false;   // some rank was asked to stop (SIGTERM or SIGINT)
  std::optional<ExpertLoad> experts;  // a mixture-of-experts model's routing figures
  std::optional<double> loss_scale;   // what the step's loss was multiplied by (float16 compute)
};

// What a run does with its weights: trains them, or keeps them as they loaded, frozen (the
// reference model of an RL loop, beside the run it trains).
enum class RunWeights { trained, frozen };

class Run {
 public:
  // Builds this rank's run (a collective over the world). UserErrors name the file, key or
  // rank at fault. A frozen run reads its weights from [model] alone (an HF directory or a
  // checkpoint; [checkpoint] is not read), holds each in its unit's compute dtype, and keeps no
  // gradients, optimizer state or loss scale: it computes forwards and log-probabilities,
  // offloads and gives its full weights, and refuses to step, save or load.
  Run(const RunConfig& config, const PlanBuilder& build_plan, RunWeights weights = RunWeights::trained);
  ~Run();
  Run(const Run&) = delete;
  Run& operator=(const Run&) = delete;

  // Restores the checkpoint [checkpoint] resume names, when there is one: the optimizer, the
  // data position, the RNG state (the parameters came in with the shards). A data stream the
  // position cannot carry over to is refused with the reason. Then records the run in its
  // out_dir (run.json), so that a refused resume leaves the record as it was.
  ResumePoint resume();
  // One optimizer step at learning rate `lr` over this rank's rows of the step's micro-batches.
  // `stop_requested` says whether this rank caught a stop signal; it is asked once the step's
  // backward is done, so a signal during the step stops the run after this step, and every
  // rank learns of it.
  StepFigures step(double lr, const std::function<bool()>& stop_requested);
  // A call into the run from a thread of its own holds it for the call's length, a backward
  // another thread runs waited out (FsdpState::begin_call); within it, settle_backward puts
  // right what a backward that ended in an exception left.
  std::unique_lock<std::mutex> begin_call();
  // A collective: the first rank that says it refused what its caller was given (this one
  // where `refused_here`), or none; every rank learns it before any other collective of the
  // call, so that all raise alike.
  std::optional<int> first_refusing_rank(bool refused_here);
  bool settle_backward();  // whether a backward had ended in an exception
  // For a caller that brings its own rows and loss (the Python API), the step in three parts.
  // First, what the gradients summed over the ranks are divided by as each reaches its shard
  // (FsdpState::set_gradient_divisor): the world size averages the ranks' losses; 1 sums them.
  void divide_gradients_by(double divisor);
  // What a backward through the units runs before its first collective (FsdpState::set_backward_check).
  void check_backwards_with(std::function<void()> check);
  // The logits [B, T, V] of `input_ids` [B, T] laid out in their rows as `layout` says (packed
  // documents, chosen positions) with `vision`, their images and videos (a vision-language
  // model's; checked as models/multimodal_positions.h says), with autograd through the units' hooks: a backward from them
  // reduce-scatters each unit's gradient into its shards, summed over the ranks and divided.
  // With autograd on, a mixture-of-experts model's routing is then summed over the ranks (a
  // collective): its load-balancing loss joins the coming backward, multiplied by the divisor
  // to survive that division, and its counts join the step's for the routing-bias update.
  // That gradient lives in one buffer the next forward with autograd refills: each forward's
  // backward must come before it.
  at::Tensor forward(const at::Tensor& input_ids, const RowLayout& layout, const VisionInputs& vision);
  // The final hidden states [B, T, C] (after the last norm, where the output head would read
  // them) of `input_ids` laid out as `layout` says with `vision`, differentiable as forward is: the features
  // a caller's own head reads (a PPO critic's value, a reward model's score). A loss on them
  // alone never reaches the output head, which apply_gradients then leaves alone.
  at::Tensor hidden_states(const at::Tensor& input_ids, const RowLayout& layout, const VisionInputs& vision);
  // Applies the gradients the caller's backward calls left, clipped by one global norm, and
  // AdamW at `lr`; skipped as a whole when the norm is not finite. A mixture-of-experts
  // model's routing biases then move as the step's routing asks ([experts] bias_update_rate).
  UpdateFigures apply_gradients(double lr);
  // Per-token log-probabilities [B, T] of `targets` [B, T] int64 after `input_ids` (with
  // `layout` and `vision` as forward takes them) at `temperature`, from the final hidden states a chunk of tokens at a time, never holding
  // [B, T, V] logits (loss/chunked_logprobs.h); differentiable as forward is. The output head
  // must sit in the root unit, which keeps it gathered from forward through backward
  // ([policy.options] fused_linear_logprob = true). `with_entropy` adds each token's entropy
  // [B, T] of that softmax, chunked and differentiable alike.
  TokenLogprobs logprobs(const at::Tensor& input_ids, const at::Tensor& targets, double temperature,
                         const RowLayout& layout, const VisionInputs& vision, bool with_entropy);
  // Each row of `prompt` [B, T] int64 (padded on the left where `kept` [B, T] bool is false;
  // undefined: no padding; with `vision`, its images and videos, a vision-language model's
  // placeholders) continued by up to options.max_new_tokens tokens chosen as
  // run/sampling.h says, over a cache of the rows' keys and values, without autograd. A row
  // ends after an eos token and holds options.pad after it; the result is [B, T + added]
  // int64 on the prompt's device. Every rank calls it: each step's forward gathers the units,
  // so a rank whose rows ended steps on until every rank's have.
  at::Tensor generate(const at::Tensor& prompt, const at::Tensor& kept, const VisionInputs& vision,
                      const GenerationOptions& options);
  // Drops every gradient, for the next backward calls to start afresh.
  void zero_grad();
  // What offload() moves off the device.
  struct Offloaded {
    bool params = false, grads = false, optimizer = false;
    std::string names() const;  // "params, optimizer"
  };
  // Between the phases of a loop that lends the device to another engine (run/run_phases.cpp):
  // moves the parameter shards, their gradients and the optimizer's state, as `what` says, to
  // host memory (pinned on a GPU) and hands the device memory they held back to the driver;
  // reload() brings them back where they train, bitwise as they were. In between,
  // apply_gradients and save refuse, and forward, logprobs and full_weights do while the
  // parameters are away.
  void offload(const Offloaded& what);
  void reload();
  // Unit `unit`'s weights (of units(), in application order) gathered whole, as (HF name,
  // tensor in `dtype`), LoRA adapters merged into their targets: the names and values
  // fsdpp export (--merge-lora) writes. A collective: every rank asks for the same unit.
  std::vector<std::pair<std::string, at::Tensor>> full_weights(size_t unit, at::ScalarType dtype);
  // The reverse: each named parameter (HF names, as full_weights gives them) replaced by the
  // full tensor given, cast to its shard's dtype, each rank keeping its own rows; the rest, the
  // optimizer's state and the step count stay. No collective: every rank is given the same.
  // check_weights refuses (UserError) what load_weights would: an unknown name (a tied head's
  // among them), a shape or dtype other than the parameter's, a run with LoRA adapters.
  void check_weights(const std::vector<std::pair<std::string, at::Tensor>>& weights);
  void load_weights(const std::vector<std::pair<std::string, at::Tensor>>& weights);
  // The directory of the model's own files (config, tokenizer, generation_config.json).
  const std::filesystem::path& model_files() const { return model_files_; }
  // Held-out evaluation over [train] eval_batches micro-batches (a collective); none where the
  // data holds nothing out.
  std::optional<EvalResult> evaluate();
  // Saves step `step` as a sharded checkpoint under `root` ([checkpoint] dir for the training
  // loop) and rotates older ones there by [checkpoint] keep and max_gb (a collective). A step
  // already saved is left as it is. `loop_state` is this rank's state of a caller's own loop
  // (JSON text, "" for none): every rank's is kept, and a rank that resumes or loads the
  // checkpoint gets back rank r % the saved world's.
  void save(int64_t step, const ClientState& state, const std::filesystem::path& root,
            const std::string& loop_state = {});
  // Replaces the parameters, the optimizer's state and the generator with those of the
  // checkpoint at `dir`, saved at any world size or mesh (a collective): for a caller that keeps
  // its run built between uses. A checkpoint that does not fit this run (another architecture,
  // other adapters or base) is refused on every rank before anything is read; a file that fails
  // to read mid-way is refused on every rank too, leaving the run partly loaded: every file's
  // checksum is verified before a row is copied, and a run left partly loaded refuses to
  // compute, step or save until a load completes.
  ResumePoint load(const std::filesystem::path& dir);
  // The run's product after step `step`: the model as an HF directory, or a LoRA run's adapter
  // in PEFT's layout (a collective: each unit gathered in turn, rank 0 writing).
  void export_final(int64_t step);

  const RunConfig& config() const { return config_; }
  bool frozen() const { return weights_ == RunWeights::frozen; }
  // Refuses `what` (step, save, load) of a frozen run, on every rank alike.
  void check_trains(const char* what) const;
  Comm& comm() { return *comm_; }
  c10::Device device() const { return device_; }
  CausalLM& model() { return *loaded_.model; }
  const CausalLM& model() const { return *loaded_.model; }
  int64_t parameters() const { return parameters_; }  // the whole model's, before sharding
  // The scale the next step's loss is multiplied by; none where the loss is not scaled.
  std::optional<double> loss_scale() const { return scaler_ ? std::optional(scaler_->scale()) : std::nullopt; }
  size_t units() const;
  Batches& batches() { return *batches_; }

 private:
  // Loads the model without memory, shards it by `plan`, each rank filling its rows from the
  // checkpoint or the weight files (then unmapped), and logs what it holds.
  void shard(const Plan& plan);
  // Saving (run/run_checkpoint.cpp): whether checkpoints hold a parameter's rows (all but a
  // LoRA run's frozen base); this rank's file, [bytes, checksum, microseconds from `start` to
  // its commit]; rank 0's metadata and commit into `root`, returning the older checkpoints it removed.
  bool saves(const ShardRows& shard) const;
  // Warns where a mixture-of-experts model's adapter written to `dir` adapts an MLP
  // projection, which peft over transformers 5 drops.
  void warn_unread_mlp_adapters(const LoraPlan& lora, const std::string& dir) const;
  at::Tensor write_rank_file(const std::filesystem::path& staging, const std::vector<ShardRows>& shards,
                             std::chrono::steady_clock::time_point start) const;
  nlohmann::json metadata(int64_t step, const ClientState& state, const std::vector<ShardRows>& shards,
                          const at::Tensor& files, const at::Tensor& rows,
                          const std::vector<std::string>& loop_states) const;
  std::vector<std::filesystem::path> commit(nlohmann::json meta, const std::filesystem::path& staging,
                                            const std::filesystem::path& root,
                                            const std::filesystem::path& final_dir) const;
  // Restoring (run/run_restore.cpp): AdamW's moments and step count from the checkpoint, the
  // loss scale, and each rank's CPU generator (rank r % the saved world's at another size).
  ResumePoint restore(const ShardedCheckpoint& checkpoint);
  void restore_optimizer(const ShardedCheckpoint& checkpoint);
  void warn_schedule_change(const nlohmann::json& meta, int64_t step, const std::string& where) const;
  void restore_loss_scale(const ShardedCheckpoint& checkpoint);
  void restore_rng(const ShardedCheckpoint& checkpoint) const;
  // UserError unless the checkpoint holds every tensor this run trains, at its full shape, no
  // tensor this run's model has not, and the same adapters (their base is load()'s to check).
  void check_fits(const ShardedCheckpoint& checkpoint) const;
  // The part of check_fits that compares the adapters (their rank, scale, modules and the
  // base modules that train beside them), said in one line before any row is read.
  void check_same_adapters(const ShardedCheckpoint& checkpoint) const;
  // Refuses, on every rank, weights that hold NaN or inf in any rank's rows.
  void check_finite_weights();
  // What identifies the contents of each file the run read (the model's weights, the
  // checkpoint it resumes, its token file), for the ranks to compare.
  std::map<std::string, std::string> sources_read() const;
  // Refuses, on every rank, a training run whose disks have no room for its first checkpoint or
  // its export (rank 0 looks, outputs.h's check_room_for_outputs); `nodes` write checkpoints.
  void check_disk_room(int nodes);
  // Runs `work` on every rank (a collective): where it fails on any, every rank raises one
  // UserError, "`what`: " and the failing rank's own message, or "`what`: `subject`: another
  // rank failed" on the others, ending in `after`.
  void on_every_rank(const std::string& what, const std::string& subject, const std::string& after,
                     const std::function<void()>& work);

  const RunConfig& config_;
  const RunWeights weights_;
  std::unique_ptr<OutDirLock> out_dir_lock_;  // rank 0's; declared first, so released last
  const std::chrono::steady_clock::time_point built_from_;  // when the build began, for the resume's log
  int64_t rows_ = 0;  // this rank's rows of every global micro-batch
  std::shared_ptr<Comm> comm_;
  c10::Device device_ = at::kCPU;
  std::shared_ptr<const ShardedCheckpoint> checkpoint_;  // the one to resume from, if any
  std::unique_ptr<Batches> batches_;
  LoadedModel loaded_;
  int64_t parameters_ = 0;
  std::unique_ptr<FsdpState> fsdp_;
  std::unique_ptr<AdamW> optimizer_;
  std::optional<ExpertBalance> experts_;  // mixture-of-experts models
  // The backwards ended (FsdpState::backwards_ended) at the last forward with autograd that
  // refilled the experts' load-balancing buffers, the Python API's.
  std::optional<int64_t> balanced_after_;
  std::weak_ptr<torch::autograd::Node> balanced_graph_;  // that forward's output's node, while it lives
  int64_t balanced_forwards_ = 0;  // forwards with autograd that refilled them, the last one's number
  std::optional<BaseIdentity> base_;      // a LoRA run's base, which its checkpoints record
  bool computes_float16_ = false;         // some unit computes in float16
  std::optional<LossScaler> scaler_;      // float16 compute's loss scale ([loss_scale])
  std::filesystem::path model_files_;     // the tokenizer's directory, which exports copy from
  bool export_in_own_run_dir_ = false;    // out_dir/export_dir's unmarked model is an old export: known at start,
                                          // before this run records itself there
  bool adapter_in_own_run_dir_ = false;   // likewise for adapter_dir's unmarked adapter
  bool head_in_root_ = false;             // the output head's weight belongs to the root unit
  bool overlaps_host_update_ = false;     // host-resident masters update beside the next forward
  std::optional<Offloaded> offloaded_;    // what offload() moved to the host, until reload()
  std::optional<std::filesystem::path> partly_loaded_from_;  // the checkpoint a load() failed to read in full

  // AdamW at `lr` under `clip` once the units have resharded; masters in host memory may
  // update on a host thread while the next forward begins ([optimizer] host_update).
  void update(double lr, const GradClip& clip);
  // After a caller's forward with autograd on: a mixture-of-experts model's routing (forward),
  // whose load-balancing gradient the backward from `output` carries.
  void balance_experts(const at::Tensor& output);
  // Before one: refuses a second such forward of a mixture-of-experts model with no backward
  // since the first, in one line beginning with `what`.
  void check_balance_consumed(const char* what) const;
  // A caller's model output, with autograd on and a loss scale, as a copy in float32 (float64
  // stays) whose gradient is multiplied by the scale: the caller's loss need not be scaled.
  at::Tensor scaled_output(const at::Tensor& output) const;
  // A UserError for `what` while offload() holds the run's state (only its parameters'
  // absence matters where `params_only`), or while a failed load() left it partly loaded.
  void check_loaded(const char* what, bool params_only = false) const;
  void check_not_offloaded(const char* what, bool params_only = false) const;
  // Verifies the checksum of every file load() will read this rank's rows and state from.
  void verify_reads(const ShardedCheckpoint& checkpoint) const;
  // Refuses `what` from inside a backward through the units (a hook that calls into the run):
  // the backward still reads the shards and gradients that a step, offload or load replaces.
  void check_outside_backward(const char* what) const;
};

}  // namespace fsdpp
