// LoRA adapters in PEFT's layout: a directory with adapter_config.json and
// adapter_model.safetensors whose tensors are named "base_model.model.<module>.lora_A.weight",
// as peft.PeftModel.from_pretrained reads them. Reading gives the adapter's LoRA plan and
// each adapter parameter's rows; writing takes the adapter parameters' full values.
#pragma once

#include "fsdp/plan.h"
#include "fsdp/sharded_param.h"
#include "io/safetensors.h"

#include <filesystem>
#include <map>
#include <memory>
#include <string>

namespace fsdpp {

class Module;

class PeftAdapter {
 public:
  // Reads and checks `dir` (a LoRA adapter, without DoRA or rsLoRA); faults are UserErrors
  // naming the file.
  static PeftAdapter open(const std::filesystem::path& dir);

  // The adapter as a plan: every module with LoRA factors in the file a target, its rank,
  // alpha and dropout, and its modules_to_save the trainable base modules.
  const LoraPlan& plan() const { return plan_; }
  // Whether the file holds the parameter (engine name): an adapter's, or one of a trainable
  // base module (PEFT's modules_to_save).
  bool holds(const std::string& name) const;
  // Refuses the adapter, before a row is read, where a tensor it holds for a parameter of
  // `model` (built with the adapters on) has another shape: a UserError naming the file and tensor.
  void check_shapes(Module& model) const;
  // Rows of the parameters it holds, as FSDP asks for them (check_shapes first).
  ShardFill fill() const;

 private:
  LoraPlan plan_;
  std::map<std::string, std::string> stored_;  // engine parameter name -> its tensor's name in the file
  std::filesystem::path dir_;
  std::shared_ptr<SafetensorsFile> weights_;
};

// Writes `tensors` (engine names with their full values: the adapters', and those of the
// trainable base modules) as a PEFT adapter of `lora` for the base model at `base_model` (of
// `model_type`, whose module paths PEFT names them by) into `dir`, atomically file by file.
// Refuses, in one line, an adapter written into `dir` that would delete anything but an
// earlier adapter of a run: `dir` may be missing, empty, or hold the two files an adapter is,
// whose weights bear the mark write_peft_adapter gives them (another program's adapter, a
// PEFT download, is never replaced). In the out_dir of a run that recorded itself there
// (`in_own_run_dir`) an unmarked adapter is taken for one of the run's own.
void check_adapter_target(const std::filesystem::path& dir, bool in_own_run_dir = false);
void write_peft_adapter(const std::filesystem::path& dir, const LoraPlan& lora, const std::string& base_model,
                        const std::string& model_type, const NamedTensors& tensors, bool in_own_run_dir = false);

}  // namespace fsdpp
