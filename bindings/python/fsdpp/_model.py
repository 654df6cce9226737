"""Run.model: forwards, log-probabilities, hidden states and generation through the run's
sharded units, with autograd, and the generation config's defaults."""
import json
import numbers
import os

import torch

from fsdpp._checks import agreed, forward_rows, number, tensor_arg, token_ids, vision_inputs
from fsdpp._fsdpp import Error

IGNORE_INDEX = -100  # a target logprobs gives 0 and no gradient, as transformers' losses ignore it


def _generation_config(run):
    """(path, values) of the model's generation_config.json, its defaults for generate (values
    {} where it has none); fsdpp.Error for one that is not a JSON object."""
    path = os.path.join(os.fsdecode(run.model_dir), "generation_config.json")
    if not os.path.isfile(path):
        return path, {}
    try:
        with open(path, encoding="utf-8") as f:
            saved = json.load(f)
    except (OSError, ValueError) as e:
        raise Error(f"{path}: not a readable JSON file: {e}")
    if not isinstance(saved, dict):
        raise Error(f"{path}: expected a JSON object, got {type(saved).__name__}")
    return path, saved


def _chosen(config, key, given, fallback=None):
    """(name for messages, value) of generate's `key`: `given`, else the generation config's
    (named by its file), else `fallback`."""
    if given is not None:
        return key, given
    path, values = config
    if values.get(key) is not None:
        return f"{path}: {key}", values[key]
    return key, fallback


def _sampling(config, temperature, top_k, top_p):
    """((temperature, top_k, top_p), their names for messages) for generate: those given, the
    rest as transformers takes them from `config` (_generation_config's): greedy where none of
    the three is given and it does not say do_sample (null: unset), else its values, else 1.0,
    50 and 1.0."""
    path, values = config
    do_sample = values.get("do_sample")
    if do_sample is not None and not isinstance(do_sample, bool):
        raise Error(f"{path}: do_sample must be true or false, got {do_sample!r}")
    if temperature is None and top_k is None and top_p is None and not do_sample:
        return (0.0, 0, 1.0), {}
    k_name, k = _chosen(config, "top_k", top_k, 50)
    if isinstance(k, torch.Tensor) and k.numel() == 1:
        k = k.item()
    if isinstance(k, bool) or not isinstance(k, numbers.Integral) or not -2**63 <= k < 2**63:
        raise Error(f"{k_name}: must be an int, got {k!r}")
    t_name, t = _chosen(config, "temperature", temperature, 1.0)
    p_name, p = _chosen(config, "top_p", top_p, 1.0)
    return (number(t_name, t), int(k), number(p_name, p)), {"temperature": t_name, "top_k": k_name, "top_p": p_name}


def _holding(run, output):
    """`output`, whose graph now holds `run`: backward runs the run's hooks, so the run lives
    as long as the graph does, even where the loop dropped its Run before calling backward."""
    if output.grad_fn is not None:
        output.grad_fn.register_prehook(lambda grads, run=run: None)
    return output


class Model:
    """The sharded model: calling it runs forward with autograd through fsdpp's units."""

    def __init__(self, run):
        self._run = run
        self._generation_config = None  # (path, values) of generation_config.json, once generate read it

    def __call__(self, input_ids, position_ids=None, document_offsets=None, attention_mask=None, **vision):
        """Logits [B, T, V] of `input_ids` [B, T] int64.

        `position_ids` [B, T] int64: each token's RoPE position (None: 0..T-1 in every row, or
        each token's distance from its document's start). `document_offsets` [S + 1] int64:
        documents packed into the rows (offsets into the rows read one after another);
        attention stays inside each. Attention is otherwise causal over the whole row.
        `attention_mask` [B, T] (1 token, 0 padding), for rows padded on the left or the right:
        each row's tokens see none of its padding and sit at positions from 0, as transformers
        computes them given position_ids = attention_mask.cumsum(-1) - 1. The padding's own
        outputs are not transformers' (it masks them otherwise); a loss leaves them out.

        A vision-language model (Qwen2-VL, Qwen2.5-VL) takes the images and videos of the rows
        by the keywords its processor gives them: pixel_values and image_grid_thw,
        pixel_values_videos, video_grid_thw and second_per_grid_ts (mm_token_type_ids, which
        must agree with the placeholders), so `run.model(**inputs)` takes a processor's output
        whole. Each image stands in the rows as its run of
        placeholder tokens, in order; the model places its tokens itself, so it takes no
        position_ids.
        """
        rows = agreed(self._run, "run.model",
                      lambda: (*forward_rows(input_ids, position_ids, document_offsets, attention_mask),
                               vision_inputs("run.model", vision)))
        return _holding(self._run, self._run.forward(*rows))

    def hidden_states(self, input_ids, position_ids=None, document_offsets=None, attention_mask=None, **vision):
        """The final hidden states [B, T, C] of `input_ids` [B, T] int64 (C: Run.hidden_size),
        after the last norm, where the output head reads them: the features a loop's own head
        maps to a PPO critic's values or a reward model's scores. Positions, documents, the
        attention mask, images and videos as calling the model takes them; differentiable as it
        is. A loss on them alone never reaches the output head, which step() then leaves as it is."""
        rows = agreed(self._run, "run.model.hidden_states",
                      lambda: (*forward_rows(input_ids, position_ids, document_offsets, attention_mask),
                               vision_inputs("run.model.hidden_states", vision)))
        return _holding(self._run, self._run.hidden_states(*rows))

    def logprobs(self, input_ids, targets, temperature=1.0, document_offsets=None, position_ids=None,
                 entropy=False, attention_mask=None, **vision):
        """Per-token log-probabilities [B, T] of `targets` [B, T] int64, the token each position
        of `input_ids` predicts, under logits divided by `temperature`: log_softmax(logits /
        temperature) at the targets, computed from the final hidden states a chunk of tokens at
        a time, so [B, T, V] logits are never held. Its gradient is that of the full
        computation. A target of IGNORE_INDEX (-100, transformers' ignored label) gives 0 and no
        gradient. The policy must keep lm_head in the root unit
        ([policy.options] fused_linear_logprob = true). With `entropy=True` it returns
        (logprobs, entropy): each token's entropy [B, T] of that softmax too, chunked alike and
        differentiable (an entropy bonus's). Positions, documents, the attention mask, images
        and videos as calling the model takes them."""
        ignored = []  # [B, T] bool, where prepare() found the targets' ignored positions

        def prepare():
            if isinstance(temperature, torch.Tensor) and temperature.requires_grad:
                raise Error("temperature: a tensor that requires grad, whose gradient this call does not give; pass "
                            "a number, or temperature.detach()")
            t = number("temperature", temperature, "a positive number")  # its range is checked by the run
            chosen = tensor_arg("targets", targets)
            if chosen.is_inference():  # saved for backward, which inference tensors cannot be
                chosen = chosen.clone()
            if chosen.dtype == torch.int64:  # transformers' ignored labels: any token in their place
                ignored.append(chosen == IGNORE_INDEX)
                chosen = chosen.masked_fill(ignored[0], 0)
            if not isinstance(entropy, bool):
                raise Error(f"entropy: must be a bool, got {type(entropy).__name__}")
            ids, positions, documents = forward_rows(input_ids, position_ids, document_offsets, attention_mask)
            return ids, chosen, t, positions, documents, vision_inputs("run.model.logprobs", vision), entropy

        outputs = [_holding(self._run, out)
                   for out in self._run.logprobs(*agreed(self._run, "run.model.logprobs", prepare))]
        if ignored:
            outputs[0] = outputs[0].masked_fill(ignored[0].to(outputs[0].device), 0.0)
        return tuple(outputs) if entropy else outputs[0]

    def generate(self, input_ids, attention_mask=None, max_new_tokens=32, temperature=None, top_k=None, top_p=None,
                 eos_token_id=None, pad_token_id=None, **vision):
        """Each row of `input_ids` [B, T] int64 continued by up to `max_new_tokens` tokens:
        [B, T + added] int64, as transformers' generate gives it. Each token is the most
        likely one (temperature 0), or drawn from softmax(logits / `temperature`) among the
        `top_k` most likely tokens (0: all) holding `top_p` of the mass (1: all), with torch's
        default generator of the run's device (torch.manual_seed). A row ends after a token of
        `eos_token_id` (an int or a list) and holds `pad_token_id` after it. What is not given
        comes from the model's generation_config.json as transformers takes it: greedy where
        none of temperature, top_k and top_p is given and the file does not say do_sample; else
        the file's values for those not given (else 1.0, 50, 1.0); its eos and pad tokens (pad
        else the first eos, else 0). `attention_mask` [B, T] (1 token, 0
        padding) marks rows padded on the left. The keys and values of every layer are cached,
        so each new token costs one token's forward. No autograd; the model's train() or eval()
        mode holds (eval() for LoRA without dropout). A vision-language model takes the
        prompt's images and videos by the keywords calling the model takes them. Every rank
        calls it: a rank whose rows ended steps on, adding nothing, until every rank's have."""
        def prepare():
            ids = tensor_arg("input_ids", input_ids)
            mask = tensor_arg("attention_mask", attention_mask, optional=True)
            if self._generation_config is None:  # read once: the model's files do not change under the run
                self._generation_config = _generation_config(self._run)
            config = self._generation_config
            sampling, names = _sampling(config, temperature, top_k, top_p)
            if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, numbers.Integral):
                raise Error(f"max_new_tokens: must be an int, got {type(max_new_tokens).__name__}")
            eos_name, eos_given = _chosen(config, "eos_token_id", eos_token_id)
            eos = token_ids(eos_name, eos_given)
            pad_name, pad_given = _chosen(config, "pad_token_id", pad_token_id)
            pad = token_ids(pad_name, pad_given)
            if len(pad) > 1:
                raise Error(f"{pad_name}: must be one token, got {pad}")
            if not -2**63 <= max_new_tokens < 2**63:
                raise Error("max_new_tokens: must fit in 64 bits")
            names.update(eos_token_id=eos_name, pad_token_id=pad_name if pad or not eos else eos_name)
            return ids, mask, int(max_new_tokens), *sampling, eos, (pad or eos or [0])[0], \
                vision_inputs("run.model.generate", vision), names

        return self._run.generate(*agreed(self._run, "run.model.generate", prepare))

    def train(self, mode=True):
        """Forwards train (`mode` True: LoRA's dropout on, as after Run()) or only compute
        (False, as eval() says), as a torch module's train() does; returns the model."""
        if not isinstance(mode, bool):
            raise Error(f"train: mode must be a bool, got {type(mode).__name__}")
        self._run.set_training(mode)
        return self

    def eval(self):
        """Forwards without LoRA's dropout, for sampling and reference log-probabilities: the
        same weights give the same outputs, so a PPO ratio starts at 1. train() turns it back on."""
        return self.train(False)

    @property
    def training(self):
        return self._run.training
