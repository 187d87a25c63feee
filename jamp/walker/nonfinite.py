"""The one test for inf and NaN that the evaluators naming the first non-finite equation share
(`jamp.debug.first_nonfinite`, anomaly mode): a code per value, NaN and inf as bits, so codes
of one equation's results or of a vmap's examples merge with `|`. Of a loop's iterations, the
first that made one counts (`first_iteration`, `keep_first`): after it, a bad value spreads to
the equations that read it, which did not make it."""

from __future__ import annotations

import functools
from typing import Any

import jax.numpy as jnp
import numpy as np

__all__ = ["CODE_DTYPE", "INF", "NAN", "code", "describe", "first_iteration", "keep_first"]

INF, NAN = 1, 2
CODE_DTYPE = np.dtype(np.int8)


def code(values: Any, *, nan: bool = True, inf: bool = True, axis: Any = None) -> Any:
    """The code of `values` (reduced over `axis`, all of them by default): `NAN` where one is
    NaN and `nan` is asked for, `INF` where one is infinite and `inf` is asked for, both, or
    zero."""
    out = jnp.zeros((), CODE_DTYPE)
    if inf:
        out = out | jnp.where(jnp.isinf(values).any(axis=axis), CODE_DTYPE.type(INF),
                              CODE_DTYPE.type(0))
    if nan:
        out = out | jnp.where(jnp.isnan(values).any(axis=axis), CODE_DTYPE.type(NAN),
                              CODE_DTYPE.type(0))
    return out


def _any(codes: dict) -> Any:
    """Whether any code of `codes` (one per key, with any leading axes) is nonzero."""
    return functools.reduce(jnp.logical_or, (c != 0 for c in codes.values()),
                            jnp.zeros((), bool))


def first_iteration(codes: dict, reverse: bool = False) -> dict:
    """The codes of a scan's first iteration that made a non-finite value, from its codes
    stacked per iteration (zeros when none did); `reverse`: the scan ran from its last
    row."""
    if not codes:
        return {}
    bad = _any(codes)
    first = jnp.argmax(bad[::-1] if reverse else bad)
    row = bad.shape[0] - 1 - first if reverse else first
    return {k: c[row] for k, c in codes.items()}


def keep_first(old: dict, new: dict) -> dict:
    """A while loop's codes after one more iteration (`new`): those so far if they name a
    non-finite value, else the iteration's. A key's codes may have any shape (one site's, or
    a group of sites')."""
    seen = functools.reduce(jnp.logical_or, (jnp.any(c != 0) for c in old.values()),
                            jnp.zeros((), bool))
    return {k: jnp.where(seen, old[k], new[k]) for k in old}


def describe(value: int) -> str:
    """"nan", "inf" or "inf and nan" for a nonzero code."""
    kinds = [name for name, bit in (("inf", INF), ("nan", NAN)) if int(value) & bit]
    return " and ".join(kinds)
