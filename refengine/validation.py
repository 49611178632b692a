"""Request input validation: pure functions from what a caller passed to clean Python values, or an
InvalidRequestError naming the field (and index) with the value and its type.

Integers are Python ints, numpy integer scalars and 0-d torch integer tensors (all normalised to int); bool is
NOT an integer here (True would silently be token 1). Token ids must lie in 0..vocab_size-1: "outside the
vocabulary" is said only of integers; a wrong type gets a type message naming the index and the type.
"""

from __future__ import annotations

import numbers
import os
from collections.abc import Iterable, Mapping, Set

import numpy as np
import torch

from refengine.errors import InvalidRequestError

_INTEGER = "an integer (int, numpy integer or 0-d integer tensor)"


def type_name(value) -> str:
    """'int', 'numpy.float32', 'torch.Tensor of torch.float32, shape [2]', ..."""
    if isinstance(value, torch.Tensor):
        return f"torch.Tensor of {value.dtype}, shape {list(value.shape)}"
    t = type(value)
    return f"numpy.{t.__name__}" if t.__module__ == "numpy" else t.__name__


def _short(value) -> str:
    r = repr(value.item() if isinstance(value, np.generic) else value)  # numpy 2 reprs: np.float64(3.0)
    return r if len(r) <= 60 else r[:57] + "..."


def integer_or_none(value) -> int | None:
    """value as an int when it is an integer in the sense above, else None."""
    if type(value) is int:  # the common case, first
        return value
    if isinstance(value, (bool, np.bool_)):
        return None
    if isinstance(value, numbers.Integral):  # int subclasses, numpy integer scalars
        return int(value)
    if (
        isinstance(value, torch.Tensor)
        and value.dim() == 0
        and not value.is_floating_point()
        and not value.is_complex()
        and value.dtype != torch.bool
    ):
        return int(value.item())
    return None


def as_int(value, field: str) -> int:
    """`value` (of request field `field`) normalised to int, or an InvalidRequestError naming both."""
    out = integer_or_none(value)
    if out is None:
        raise InvalidRequestError(f"{field}={_short(value)} ({type_name(value)}): expected {_INTEGER}")
    return out


def as_bool(value, field: str) -> bool:
    """True/False (numpy bools too); 0, 1, 'false' and None are refused rather than guessed."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise InvalidRequestError(f"{field}={_short(value)} ({type_name(value)}): expected True or False")


def as_real(value, field: str) -> float:
    """A real number (int, float, numpy scalar, 0-d non-bool tensor) as float; bool and str refused."""
    if isinstance(value, torch.Tensor) and value.dim() == 0 and value.dtype != torch.bool and not value.is_complex():
        return float(value.item())
    if isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_)):
        return float(value)
    raise InvalidRequestError(f"{field}={_short(value)} ({type_name(value)}): expected a number")


def validate_token_ids(ids, vocab_size: int, field: str) -> list[int]:
    """Token ids (a list, tuple, 1-d numpy array or 1-d torch tensor of integers) as a list of ints in
    0..vocab_size-1. Usable for prompts and for forced / scored continuation ids. Empty is allowed here."""
    if isinstance(ids, (str, bytes, bytearray)):
        raise InvalidRequestError(
            f"{field}={_short(ids)} ({type_name(ids)}): expected a sequence of token ids (tokenize text first)"
        )
    if isinstance(ids, (np.ndarray, torch.Tensor)):
        if ids.ndim != 1:
            raise InvalidRequestError(
                f"{field} has shape {list(ids.shape)} ({type_name(ids)}): expected a 1-d "
                f"sequence of token ids (one request per call)"
            )
        integral = (
            ids.dtype.kind in "iu"
            if isinstance(ids, np.ndarray)
            else not (ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool)
        )
        values = ids.tolist() if integral else list(ids)  # not integral: the loop below names the first bad one
    elif isinstance(ids, Iterable) and not isinstance(ids, (Mapping, Set)):
        values = list(ids)
    else:
        raise InvalidRequestError(f"{field}={_short(ids)} ({type_name(ids)}): expected a list of token ids")
    out = []
    for i, t in enumerate(values):
        v = integer_or_none(t)
        if v is None:
            hint = " (tokenize text first)" if isinstance(t, str) else ""
            raise InvalidRequestError(f"{field}[{i}]={_short(t)} ({type_name(t)}): token ids must be integers{hint}")
        out.append(v)
    bad = [(i, t) for i, t in enumerate(out) if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequestError(
            f"{field}: ids {[t for _, t in bad[:5]]} at positions {[i for i, _ in bad[:5]]}"
            f"{f' (and {len(bad) - 5} more)' if len(bad) > 5 else ''} outside the vocabulary 0..{vocab_size - 1}"
        )
    return out


def validate_prompt(prompt_ids, vocab_size: int) -> list[int]:
    """A prompt as a non-empty list of in-vocabulary ints (see validate_token_ids)."""
    out = validate_token_ids(prompt_ids, vocab_size, "prompt_ids")
    if not out:
        raise InvalidRequestError("empty prompt: at least one token is needed")
    return out


def decode_prompt_arg(raw: str | bytes, source: str = "--prompt") -> str:
    """Prompt text from the command line (or any bytes) as a str that is valid Unicode, or an
    InvalidRequestError saying which byte is not UTF-8 and where.

    On Linux, argv bytes the locale cannot decode arrive as lone surrogates (surrogateescape); the original
    bytes are recovered with os.fsencode and decoded as UTF-8 (so UTF-8 text under a non-UTF-8 locale is
    recovered, not refused). `source` names the input in the message ('--prompt', a file name, ...)."""
    if isinstance(raw, str):
        try:
            raw.encode("utf-8")
            return raw
        except UnicodeEncodeError:
            pass
        try:
            data = os.fsencode(raw)
        except UnicodeEncodeError as e:
            raise InvalidRequestError(
                f"{source}: character {e.start} is a lone surrogate U+{ord(raw[e.start]):04X}, not text; "
                f"pass valid Unicode"
            ) from None
    elif isinstance(raw, (bytes, bytearray)):
        data = bytes(raw)
    else:
        raise InvalidRequestError(f"{source}={_short(raw)} ({type_name(raw)}): expected text (str or UTF-8 bytes)")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        bad = data[e.start : e.end]
        before = data[max(0, e.start - 24) : e.start].decode("utf-8", "replace")
        raise InvalidRequestError(
            f"{source} is not valid UTF-8: byte {bad.hex(' ')} at byte offset {e.start} of {len(data)} "
            f"({e.reason}) after {before!r}; re-encode the text as UTF-8 "
            f"(e.g. iconv -f LATIN1 -t UTF-8)"
        ) from None
