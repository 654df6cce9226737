"""fsdpp from Python: the run the fsdpp binary trains, driven by a Python loop.

    run = fsdpp.Run("examples/tiny-llama.toml", overrides={"train.out_dir": "runs/x"})
    logits = run.model(input_ids)          # [B, T, V], autograd through the sharded units
    loss = my_loss(logits)                 # any loss the loop computes
    loss.backward()                        # reduce-scatters each unit's gradient
    grad_norm, stepped = run.step()        # one global clip, AdamW, the run's schedule
    run.zero_grad()

A process is one rank: started by torchrun (or fsdpp launch), every rank builds its Run;
started alone, it is a world of one. Errors in the run file, the policy or the inputs raise
fsdpp.Error, one line naming the file and key. docs/python.md has the whole API.
"""
import collections.abc
import json
import numbers
import os
import re

import torch  # LibTorch first: the extension links against the copy torch loads

from fsdpp._fsdpp import Error
from fsdpp._fsdpp import OpCounter as _OpCounter
from fsdpp._fsdpp import Run as _Run

__all__ = ["Error", "IGNORE_INDEX", "Run", "count_ops"]

IGNORE_INDEX = -100  # a target logprobs gives 0 and no gradient, as transformers' losses ignore it


# A dotted key of TOML bare keys: what --set takes before its '='.
_OVERRIDE_KEY = re.compile(r"[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*")


def _overrides(overrides):
    """`overrides` as --set's KEY=VALUE texts."""
    if overrides is None:
        return []
    if not isinstance(overrides, collections.abc.Mapping):
        raise Error(f"overrides: expected a mapping of dotted keys to values, got {type(overrides).__name__}")
    sets = []
    for key, value in overrides.items():
        if not isinstance(key, str) or not _OVERRIDE_KEY.fullmatch(key):
            raise Error(f"overrides: {key!r} is not a dotted key such as 'train.out_dir'")
        sets.append(f"{key}={_toml_value(key, value)}")
    return sets


def _toml_value(key, value):
    """`value` as TOML text for the override `key`, as --set takes it."""
    if isinstance(value, bool):
        return "true" if value else "false"
    # numbers' kinds take numpy's scalars as well
    if isinstance(value, numbers.Integral):
        if not -2**63 <= value < 2**63:
            raise Error(f"overrides: {key}: {value} is outside TOML's 64-bit integers")
        return str(int(value))
    if isinstance(value, numbers.Real):
        return repr(float(value))
    if isinstance(value, (str, os.PathLike)):
        text = os.fspath(value)
        if isinstance(text, bytes) or any("\ud800" <= c <= "\udfff" for c in text):
            raise Error(f"overrides: {key}: a run file's strings are UTF-8 text, and this one is not "
                        "(a name os.listdir could not decode?)")
        # A JSON string is a TOML basic string, given its characters as they are: JSON's
        # escapes of characters past U+FFFF are surrogate pairs, which TOML refuses.
        return json.dumps(text, ensure_ascii=False)
    raise Error(f"overrides: {key}: expected a bool, int, float, str or path, got {type(value).__name__}")


def _tensor(name, value, optional=False):
    """`value`, a tensor with values (or None where `optional`); else fsdpp.Error."""
    if value is None and optional:
        return None
    if not isinstance(value, torch.Tensor):
        raise Error(f"{name}: expected a torch.Tensor, got {type(value).__name__}")
    if value.is_meta:
        raise Error(f"{name}: a meta tensor, which holds no values")
    if value.is_nested or value.layout != torch.strided:
        raise Error(f"{name}: expected a dense tensor, got a {'nested' if value.is_nested else value.layout} one")
    return value.rename(None) if value.has_names() else value


def _mask_documents(attention_mask, input_ids, document_offsets):
    """`attention_mask` [B, T] (1 for a token, 0 for padding; None: none) as document offsets
    that keep each row's padding apart from its tokens: a left- or right-padded row is two
    documents, its tokens at positions from 0, as transformers places them given
    position_ids = mask.cumsum(-1) - 1. Else `document_offsets` as given; fsdpp.Error for both,
    a mask of another shape, or a row whose tokens are split by padding."""
    if attention_mask is None:
        return document_offsets
    mask = _tensor("attention_mask", attention_mask)
    if document_offsets is not None:
        raise Error("attention_mask: give it or document_offsets, not both")
    if not isinstance(input_ids, torch.Tensor) or mask.shape != input_ids.shape or mask.dim() != 2:
        shape = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else None
        raise Error(f"attention_mask: expected input_ids' shape {shape}, got {tuple(mask.shape)}")
    if mask.is_complex() or mask.is_floating_point() or not bool(((mask == 0) | (mask == 1)).all()):
        raise Error("attention_mask: expected 1 for a token and 0 for padding, in an integer or bool tensor")
    mask = mask.to("cpu", torch.bool)
    rows, tokens = mask.shape
    if rows == 0 or tokens == 0:
        return None  # no rows to lay out: input_ids' own check refuses them
    # A run of tokens starts where a row starts with one or a token follows padding.
    starts = mask[:, 0].long() + (mask[:, 1:] & ~mask[:, :-1]).sum(1)  # [B]
    if bool((starts > 1).any()):
        row = int((starts > 1).nonzero()[0])
        raise Error(f"attention_mask: row {row} has padding between its tokens; fsdpp takes rows padded on the left "
                    "or the right (documents packed into a row: document_offsets)")
    changes = (mask[:, 1:] != mask[:, :-1]).nonzero()  # [K, 2]: (row, t - 1) where position t differs
    bounds = torch.cat([torch.arange(rows + 1) * tokens, changes[:, 0] * tokens + changes[:, 1] + 1])
    return torch.unique(bounds)  # sorted


# A vision-language model's images and videos, by the names transformers' processors give them.
_VISION_INPUTS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "second_per_grid_ts",
                  "mm_token_type_ids")


def _vision(call, given):
    """The images and videos a forward got as keyword arguments, each a tensor; None leaves one
    out. fsdpp.Error for another keyword. Their shapes and the rows' placeholders are checked
    by the run."""
    vision = {}
    for name, value in given.items():
        if name not in _VISION_INPUTS:
            raise Error(f"{call}: unexpected keyword argument {name!r} (images and videos go by "
                        f"{', '.join(_VISION_INPUTS)})")
        tensor = _tensor(name, value, optional=True)
        if tensor is not None:
            # saved for backward by the vision tower, which inference tensors cannot be
            vision[name] = tensor.clone() if tensor.is_inference() else tensor
    return vision


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


def _digits(integer):
    """How many digits an integer too large to print whole has."""
    return len(str(abs(int(integer))))


def _number(name, value):
    """`value` (a Python or numpy number, or a one-element tensor) as a float; else fsdpp.Error."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_complex():
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise Error(f"{name}: must be a number, got {type(value).__name__}")
    if isinstance(value, numbers.Integral) and abs(value) > 1e300:
        raise Error(f"{name}: must be a number within a float's range, got an integer of {_digits(value)} digits")
    return float(value)


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
    return (_number(t_name, t), int(k), _number(p_name, p)), {"temperature": t_name, "top_k": k_name, "top_p": p_name}


def _token_ids(name, value):
    """`value` (None, an int, a list of ints, or a tensor of them) as a list of ints; else fsdpp.Error."""
    if value is None:
        return []
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    tokens = [value] if isinstance(value, numbers.Integral) else list(value) if isinstance(value, (list, tuple)) else None
    if tokens is None or any(isinstance(t, bool) or not isinstance(t, numbers.Integral) or not -2**63 <= t < 2**63
                             for t in tokens):
        raise Error(f"{name}: must be an int or a list of ints, got {value!r}")
    return [int(t) for t in tokens]


def _rows(input_ids, position_ids, document_offsets, attention_mask):
    """The checked (input_ids, position_ids, document_offsets) of a forward's rows."""
    return (_tensor("input_ids", input_ids), _tensor("position_ids", position_ids, optional=True),
            _tensor("document_offsets", _mask_documents(attention_mask, input_ids, document_offsets), optional=True))


def _path(name, value):
    """`value` as a path's bytes (a name os.listdir could not decode included); else fsdpp.Error."""
    if not isinstance(value, (str, bytes, os.PathLike)):
        raise Error(f"{name}: expected a str, bytes or path, got {type(value).__name__}")
    path = os.fsencode(value)
    if b"\0" in path:
        raise Error(f"{name}: the path holds a NUL byte")
    return path


def _loop_state_text(value):
    """`value` as JSON text, "" for None; else fsdpp.Error."""
    if value is None:
        return ""
    try:
        return json.dumps(value, allow_nan=False)
    except (TypeError, ValueError, RecursionError) as e:
        raise Error(f"save: loop_state must be a JSON value (dicts, lists, str, finite numbers, bool, None): {e}")


def _holding(run, output):
    """`output`, whose graph now holds `run`: backward runs the run's hooks, so the run lives
    as long as the graph does, even where the loop dropped its Run before calling backward."""
    if output.grad_fn is not None:
        output.grad_fn.register_prehook(lambda grads, run=run: None)
    return output


def _agreed(run, call, prepare):
    """prepare()'s checked arguments of `call`. Where this rank's are refused, every rank learns
    of it before the call's first collective and raises too (the run checks what it is given
    the same way), so that none waits in collectives another skips."""
    try:
        return prepare()
    except Error as refused:
        error = refused
    except Exception as e:  # an argument the checks did not foresee: refused all the same
        error = Error(f"{call}: {type(e).__name__}: {e}")
    run.refuse_inputs(call)
    raise error


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
        rows = _agreed(self._run, "run.model", lambda: (*_rows(input_ids, position_ids, document_offsets, attention_mask),
                                                        _vision("run.model", vision)))
        return _holding(self._run, self._run.forward(*rows))

    def hidden_states(self, input_ids, position_ids=None, document_offsets=None, attention_mask=None, **vision):
        """The final hidden states [B, T, C] of `input_ids` [B, T] int64 (C: Run.hidden_size),
        after the last norm, where the output head reads them: the features a loop's own head
        maps to a PPO critic's values or a reward model's scores. Positions, documents, the
        attention mask, images and videos as calling the model takes them; differentiable as it
        is. A loss on them alone never reaches the output head, which step() then leaves as it is."""
        rows = _agreed(self._run, "run.model.hidden_states",
                       lambda: (*_rows(input_ids, position_ids, document_offsets, attention_mask),
                                _vision("run.model.hidden_states", vision)))
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
            t = temperature
            if isinstance(t, torch.Tensor) and t.requires_grad:
                raise Error("temperature: a tensor that requires grad, whose gradient this call does not give; pass "
                            "a number, or temperature.detach()")
            if isinstance(t, torch.Tensor) and t.numel() == 1 and not t.is_complex():
                t = t.item()  # a loop's scalar tensor
            # numbers.Real takes numpy's scalars as well
            if isinstance(t, bool) or not isinstance(t, numbers.Real):
                raise Error(f"temperature: must be a positive number, got {type(t).__name__}")
            if isinstance(t, numbers.Integral) and abs(t) > 1e300:
                raise Error(f"temperature: must be a positive number within a float's range, got an integer of "
                            f"{_digits(t)} digits")
            chosen = _tensor("targets", targets)
            if chosen.is_inference():  # saved for backward, which inference tensors cannot be
                chosen = chosen.clone()
            if chosen.dtype == torch.int64:  # transformers' ignored labels: any token in their place
                ignored.append(chosen == IGNORE_INDEX)
                chosen = chosen.masked_fill(ignored[0], 0)
            if not isinstance(entropy, bool):
                raise Error(f"entropy: must be a bool, got {type(entropy).__name__}")
            ids, positions, documents = _rows(input_ids, position_ids, document_offsets, attention_mask)
            return ids, chosen, float(t), positions, documents, _vision("run.model.logprobs", vision), entropy

        outputs = [_holding(self._run, out)
                   for out in self._run.logprobs(*_agreed(self._run, "run.model.logprobs", prepare))]
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
            ids = _tensor("input_ids", input_ids)
            mask = _tensor("attention_mask", attention_mask, optional=True)
            if self._generation_config is None:  # read once: the model's files do not change under the run
                self._generation_config = _generation_config(self._run)
            config = self._generation_config
            sampling, names = _sampling(config, temperature, top_k, top_p)
            if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, numbers.Integral):
                raise Error(f"max_new_tokens: must be an int, got {type(max_new_tokens).__name__}")
            eos_name, eos_given = _chosen(config, "eos_token_id", eos_token_id)
            eos = _token_ids(eos_name, eos_given)
            pad_name, pad_given = _chosen(config, "pad_token_id", pad_token_id)
            pad = _token_ids(pad_name, pad_given)
            if len(pad) > 1:
                raise Error(f"{pad_name}: must be one token, got {pad}")
            if not -2**63 <= max_new_tokens < 2**63:
                raise Error("max_new_tokens: must fit in 64 bits")
            names.update(eos_token_id=eos_name, pad_token_id=pad_name if pad or not eos else eos_name)
            return ids, mask, int(max_new_tokens), *sampling, eos, (pad or eos or [0])[0], \
                _vision("run.model.generate", vision), names

        return self._run.generate(*_agreed(self._run, "run.model.generate", prepare))

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


class Run:
    """One rank's training run, built from a run file as `fsdpp train` builds it.

    `overrides` maps dotted keys to values, as --set does for the binary:
    {"train.out_dir": "runs/x", "policy.options.lora_rank": 8}. The run file's [data] is not
    read: the loop brings its own rows. `grad_reduction` "mean" averages gradients over the
    data-parallel ranks (as DDP and FSDP2 do); "sum" leaves them summed.

    `frozen=True` builds a reference model: the weights [model] path gives (an HF directory or
    a checkpoint; [checkpoint] is not read), each held in its unit's compute dtype, with no
    gradients or optimizer state, in eval() mode. It forwards, gives log-probabilities, offloads
    and gives its full weights; step, save and load raise fsdpp.Error.
    """

    def __init__(self, toml_path, overrides=None, grad_reduction="mean", frozen=False):
        toml_path = _path("toml_path", toml_path)
        if not isinstance(grad_reduction, str):
            raise Error(f"grad_reduction: expected \"mean\" or \"sum\", got {type(grad_reduction).__name__}")
        if not isinstance(frozen, bool):
            raise Error(f"frozen: expected a bool, got {type(frozen).__name__}")
        self._run = _Run(toml_path, _overrides(overrides), grad_reduction, frozen)
        self.model = Model(self._run)

    def step(self, lr=None):
        """Applies the gradients of the backward calls since zero_grad: divided as grad_reduction
        says, clipped by [train] clip_grad_norm over every rank, AdamW at `lr` (None: the
        [scheduler]'s rate for this step, `scheduled_lr`; a loop's own schedule gives its rate
        here, the same on every rank). Returns (grad_norm, stepped); a norm that is not finite
        skips the update."""
        def prepare():
            rate = lr.item() if isinstance(lr, torch.Tensor) and lr.numel() == 1 and not lr.is_complex() else lr
            if rate is None:
                return None
            if isinstance(rate, bool) or not isinstance(rate, numbers.Real):
                raise Error(f"step: lr must be a number in [0, 1e6], got {type(rate).__name__}")
            if isinstance(rate, numbers.Integral) and abs(rate) > 1e6:
                shown = rate if abs(rate) < 1e18 else f"an integer of {_digits(rate)} digits"
                raise Error(f"step: lr must be a number in [0, 1e6], got {shown}")
            return float(rate)  # its range is checked with the other ranks
        return self._run.step(_agreed(self._run, "step", prepare))

    def full_weights(self, dtype=torch.bfloat16):
        """Yields (HF name, tensor) for every weight, gathered whole one unit at a time (every
        rank must iterate alike: each unit's gather is a collective), LoRA adapters merged into
        their targets: the names and values `fsdpp export` writes for this step, ready for an
        inference engine's load_weights. Beyond the shards, one unit's weights are held at a time."""
        def prepare():  # agreed with the first unit's call, which every rank makes
            if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
                raise Error(f"full_weights: dtype must be a floating torch.dtype, got {dtype!r}")
            return str(dtype).removeprefix("torch.")
        name = _agreed(self._run, "full_weights", prepare)
        version = self._run.weights_version
        for unit in range(self._run.units):
            # Every rank steps alike, so every rank raises here alike.
            if self._run.weights_version != version:
                raise Error("full_weights: the run stepped or loaded while this iteration was under way, so the "
                            "units it handed out and the rest are of two states; iterate again")
            yield from self._run.full_weights(unit, name)

    def load_weights(self, weights):
        """Replaces each named parameter with the full tensor given: `weights` yields (HF name,
        tensor) pairs, as full_weights() gives them (every rank the same, in the same order;
        each rank keeps its own rows, cast to its shards' dtype). The parameters not named, the
        optimizer's state and the step count stay. A frozen reference model refreshed from the
        actor: ref.load_weights(actor.full_weights(dtype=torch.float32)). Pairs are taken one at
        a time, so no more than the one given is held: a run with LoRA adapters, a name the
        model lacks (a tied head's lm_head.weight among them), or a tensor of another shape
        raises fsdpp.Error on every rank, the pairs before it loaded and it and the rest not. So
        do ranks that give different names, shapes or dtypes at one place, or a different number
        of pairs, and an error raised by `weights` itself on one rank."""
        pairs = None

        def prepare():
            nonlocal pairs
            try:
                if pairs is None:
                    pairs = iter(weights.items() if isinstance(weights, collections.abc.Mapping) else weights)
                pair = next(pairs)
            except StopIteration:
                return []  # the end, which every rank must reach together
            except Error:
                raise
            except Exception as e:  # the loop's own iterator: every rank must learn of it
                raise Error(f"load_weights: taking the next pair raised {type(e).__name__}: {e}")
            if not isinstance(pair, (tuple, list)) or len(pair) != 2 or not isinstance(pair[0], str):
                raise Error(f"load_weights: expected (name, tensor) pairs, got {type(pair).__name__}")
            return [(pair[0], _tensor(pair[0], pair[1]).detach())]

        while self._run.load_weights(_agreed(self._run, "load_weights", prepare)):
            pass

    def save(self, dir=None, loop_state=None):
        """Saves the run at its step count as `fsdpp train` does: a sharded checkpoint
        step-NNNNNNNN under `dir` (None: the run file's [checkpoint] dir); older ones there
        rotate by [checkpoint] keep and max_gb. Every rank calls it. Returns the checkpoint's
        path, which load() reads back into a built Run, and a later Run (or `fsdpp train`)
        resumes from with overrides={"checkpoint.resume": path}, at any world size;
        `fsdpp export` turns it into a Hugging Face directory.

        `loop_state` is this rank's state of the loop itself (its place in the prompts, a KL
        coefficient, sampling seeds), any JSON value: it is committed with the checkpoint, and
        load() or a resumed Run gives it back (`loop_state`) as json.loads reads it."""
        root, state = _agreed(self._run, "save", lambda: (None if dir is None else _path("save", dir),
                                                           _loop_state_text(loop_state)))
        return os.fsdecode(self._run.save(root, state))

    def load(self, path):
        """Replaces the parameters, the optimizer's state and the step count with those of the
        checkpoint at `path` (one save() returned, or `fsdpp train` wrote), saved at any world
        size: each rank reads its rows of the current sharding. Every rank calls it. A
        checkpoint of another architecture, other adapters or another base raises fsdpp.Error
        before anything is read. Gradients of backward calls before it, which are of other
        weights, are dropped. Returns the checkpoint's loop state for this rank (None where none
        was saved), as `loop_state` then gives it."""
        self._run.load(_agreed(self._run, "load", lambda: _path("load", path)))
        return self.loop_state

    @property
    def loop_state(self):
        """The loop state save() kept in the checkpoint this run resumed from or last loaded:
        this rank's, or at another world size rank r % the saved world's; None where none was
        saved (or the run started fresh)."""
        text = self._run.loop_state
        return json.loads(text) if text else None

    def offload(self, what=("params", "grads", "optimizer")):
        """Moves the named state off the device, to host memory (pinned on a GPU), and hands the
        device memory it held back to the driver: for a serving engine beside the trainer to
        use while it samples. Until reload(), step and save raise fsdpp.Error, and so do the
        model, logprobs and full_weights while the params are away. Every rank calls it."""
        def prepare():
            names = (what,) if isinstance(what, str) else what
            if not isinstance(names, collections.abc.Iterable) or isinstance(names, (bytes, bytearray)):
                raise Error(f"offload: expected names among params, grads, optimizer, got {type(names).__name__}")
            names = list(names)
            for name in names:
                if not isinstance(name, str):
                    raise Error(f"offload: {name!r} is not one of params, grads, optimizer")
            return names
        self._run.offload(_agreed(self._run, "offload", prepare))

    def reload(self):
        """Brings back what offload() moved, bitwise as it was, where the run trains; with
        nothing offloaded it does nothing."""
        self._run.reload()

    def zero_grad(self):
        """Drops the gradients, for the next backward calls to start afresh."""
        self._run.zero_grad()

    @property
    def frozen(self):
        """Whether the run is a frozen reference model (Run(..., frozen=True))."""
        return self._run.frozen

    @property
    def rank(self):
        return self._run.rank

    @property
    def world_size(self):
        return self._run.world_size

    @property
    def steps(self):
        """Optimizer steps applied so far (a resumed run counts its checkpoint's)."""
        return self._run.steps

    @property
    def scheduled_lr(self):
        """The learning rate the [scheduler] gives the next step() (at step `steps` + 1)."""
        return self._run.scheduled_lr

    @property
    def loss_scale(self):
        """The scale float16 compute multiplies the gradients by ([loss_scale]); None where the
        run does not scale. The loop's loss needs no scaling of its own: the model's outputs
        are float32 and carry the scale into backward, and step() divides it out."""
        return self._run.loss_scale

    @property
    def device(self):
        return torch.device(self._run.device)

    @property
    def hidden_size(self):
        """The width C of the model's hidden states (its config's hidden_size)."""
        return self._run.hidden_size


class count_ops:
    """Counts the kernels the code inside `with` launches, fsdpp's or any other PyTorch code's,
    as `[metrics] count_step` counts a step of the binary (engine/metrics/op_count.h):

        with fsdpp.count_ops() as counted:
            train_step()
        counted.counts["kernels"], counted.counts["other_bytes"], counted.counts["ops"]

    One count at a time in a process; nothing else may run operators on another thread when it
    starts or stops."""

    def __enter__(self):
        self.counts = None
        self._counter = _OpCounter()
        return self

    def __exit__(self, *exc):
        self.counts = json.loads(self._counter.stop())
        return False
