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

import torch  # LibTorch first: the extension links against the copy torch loads

from fsdpp._checks import agreed, digits, loop_state_text, override_sets, path_bytes, tensor_arg
from fsdpp._fsdpp import Error
from fsdpp._fsdpp import OpCounter as _OpCounter
from fsdpp._fsdpp import Run as _Run
from fsdpp._model import IGNORE_INDEX, Model

__all__ = ["Error", "IGNORE_INDEX", "Run", "count_ops"]


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
        toml_path = path_bytes("toml_path", toml_path)
        if not isinstance(grad_reduction, str):
            raise Error(f"grad_reduction: expected \"mean\" or \"sum\", got {type(grad_reduction).__name__}")
        if not isinstance(frozen, bool):
            raise Error(f"frozen: expected a bool, got {type(frozen).__name__}")
        self._run = _Run(toml_path, override_sets(overrides), grad_reduction, frozen)
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
                shown = rate if abs(rate) < 1e18 else f"an integer of {digits(rate)} digits"
                raise Error(f"step: lr must be a number in [0, 1e6], got {shown}")
            return float(rate)  # its range is checked with the other ranks
        return self._run.step(agreed(self._run, "step", prepare))

    def full_weights(self, dtype=torch.bfloat16):
        """Yields (HF name, tensor) for every weight, gathered whole one unit at a time (every
        rank must iterate alike: each unit's gather is a collective), LoRA adapters merged into
        their targets: the names and values `fsdpp export` writes for this step, ready for an
        inference engine's load_weights. Beyond the shards, one unit's weights are held at a time."""
        def prepare():  # agreed with the first unit's call, which every rank makes
            if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
                raise Error(f"full_weights: dtype must be a floating torch.dtype, got {dtype!r}")
            return str(dtype).removeprefix("torch.")
        name = agreed(self._run, "full_weights", prepare)
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
        model lacks (a tied head's lm_head.weight among them), a tensor of another shape, or
        one holding NaN or inf raises fsdpp.Error on every rank, the pairs before it loaded and it and the rest not. So
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
            tensor = tensor_arg(pair[0], pair[1]).detach()
            # weights of NaN or inf would give NaN outputs, as the run's own loads refuse them
            if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                raise Error(f"load_weights: '{pair[0]}' holds NaN or inf: the weights are not finite")
            return [(pair[0], tensor)]

        while self._run.load_weights(agreed(self._run, "load_weights", prepare)):
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
        root, state = agreed(self._run, "save", lambda: (None if dir is None else path_bytes("save", dir),
                                                          loop_state_text(loop_state)))
        return os.fsdecode(self._run.save(root, state))

    def load(self, path):
        """Replaces the parameters, the optimizer's state and the step count with those of the
        checkpoint at `path` (one save() returned, or `fsdpp train` wrote), saved at any world
        size: each rank reads its rows of the current sharding. Every rank calls it. A
        checkpoint of another architecture, other adapters or another base raises fsdpp.Error
        before anything is read. Gradients of backward calls before it, which are of other
        weights, are dropped. Returns the checkpoint's loop state for this rank (None where none
        was saved), as `loop_state` then gives it."""
        self._run.load(agreed(self._run, "load", lambda: path_bytes("load", path)))
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
        self._run.offload(agreed(self._run, "offload", prepare))

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
