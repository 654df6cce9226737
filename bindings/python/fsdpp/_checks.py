"""The checks of what a Python loop hands the run: each argument refused with one fsdpp.Error
line naming it, and turned into what the extension takes (TOML text, tensors, path bytes)."""
import collections.abc
import json
import numbers
import os
import re

import torch

from fsdpp._fsdpp import Error


# A dotted key of TOML bare keys: what --set takes before its '='.
OVERRIDE_KEY = re.compile(r"[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*")


def override_sets(overrides):
    """`overrides` as --set's KEY=VALUE texts."""
    if overrides is None:
        return []
    if not isinstance(overrides, collections.abc.Mapping):
        raise Error(f"overrides: expected a mapping of dotted keys to values, got {type(overrides).__name__}")
    sets = []
    for key, value in overrides.items():
        if not isinstance(key, str) or not OVERRIDE_KEY.fullmatch(key):
            raise Error(f"overrides: {key!r} is not a dotted key such as 'train.out_dir'")
        sets.append(f"{key}={toml_value(key, value)}")
    return sets


def toml_value(key, value):
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


def tensor_arg(name, value, optional=False):
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


def documents_of_mask(attention_mask, input_ids, document_offsets):
    """`attention_mask` [B, T] (1 for a token, 0 for padding; None: none) as document offsets
    that keep each row's padding apart from its tokens: a left- or right-padded row is two
    documents, its tokens at positions from 0, as transformers places them given
    position_ids = mask.cumsum(-1) - 1. Else `document_offsets` as given; fsdpp.Error for both,
    a mask of another shape, or a row whose tokens are split by padding."""
    if attention_mask is None:
        return document_offsets
    mask = tensor_arg("attention_mask", attention_mask)
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
VISION_INPUTS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "second_per_grid_ts",
                  "mm_token_type_ids")


def vision_inputs(call, given):
    """The images and videos a forward got as keyword arguments, each a tensor; None leaves one
    out. fsdpp.Error for another keyword. Their shapes and the rows' placeholders are checked
    by the run."""
    vision = {}
    for name, value in given.items():
        if name not in VISION_INPUTS:
            raise Error(f"{call}: unexpected keyword argument {name!r} (images and videos go by "
                        f"{', '.join(VISION_INPUTS)})")
        tensor = tensor_arg(name, value, optional=True)
        if tensor is not None:
            # saved for backward by the vision tower, which inference tensors cannot be
            vision[name] = tensor.clone() if tensor.is_inference() else tensor
    return vision


def digits(integer):
    """How many digits an integer too large to print whole has."""
    return len(str(abs(int(integer))))


def number(name, value, kind="a number"):
    """`value` (a Python or numpy number, or a one-element tensor) as a float; else fsdpp.Error
    saying it must be `kind`."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_complex():
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise Error(f"{name}: must be {kind}, got {type(value).__name__}")
    if isinstance(value, numbers.Integral) and abs(value) > 1e300:
        raise Error(f"{name}: must be {kind} within a float's range, got an integer of {digits(value)} digits")
    return float(value)


def token_ids(name, value):
    """`value` (None, an int, a list of ints, or a tensor of them) as a list of ints; else fsdpp.Error."""
    if value is None:
        return []
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    tokens = ([value] if isinstance(value, numbers.Integral) else
              list(value) if isinstance(value, (list, tuple)) else None)
    if tokens is None or any(isinstance(t, bool) or not isinstance(t, numbers.Integral) or not -2**63 <= t < 2**63
                             for t in tokens):
        raise Error(f"{name}: must be an int or a list of ints, got {value!r}")
    return [int(t) for t in tokens]


def forward_rows(input_ids, position_ids, document_offsets, attention_mask):
    """The checked (input_ids, position_ids, document_offsets) of a forward's rows."""
    documents = documents_of_mask(attention_mask, input_ids, document_offsets)
    return (tensor_arg("input_ids", input_ids), tensor_arg("position_ids", position_ids, optional=True),
            tensor_arg("document_offsets", documents, optional=True))


def path_bytes(name, value):
    """`value` as a path's bytes (a name os.listdir could not decode included); else fsdpp.Error."""
    if not isinstance(value, (str, bytes, os.PathLike)):
        raise Error(f"{name}: expected a str, bytes or path, got {type(value).__name__}")
    path = os.fsencode(value)
    if b"\0" in path:
        raise Error(f"{name}: the path holds a NUL byte")
    return path


def loop_state_text(value):
    """`value` as JSON text, "" for None; else fsdpp.Error."""
    if value is None:
        return ""
    try:
        return json.dumps(value, allow_nan=False)
    except (TypeError, ValueError, RecursionError) as e:
        raise Error(f"save: loop_state must be a JSON value (dicts, lists, str, finite numbers, bool, None): {e}")


def agreed(run, call, prepare):
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
