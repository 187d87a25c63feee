"""The casts both forms of `jamp.initialize` (linen and NNX) apply around a model, and Apex's
float32 check of the models it is given."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from jamp.policy.dtypes import FLOAT32, is_floating


def check_float32(where: str, dtype: Any) -> None:
    """Apex's float32 check of the models given to initialize (their params and buffers),
    with the way out: a half value is what initialize returns (a second pass), float64 is
    cast by the user.

    Raises:
      ValueError: a real floating `dtype` other than float32.
    """
    dtype = np.dtype(dtype)
    if not is_floating(dtype) or dtype == FLOAT32:
        return
    if dtype == np.float64:
        hint = "Cast the model to float32 first."
    else:
        hint = ("Half values are what jamp.initialize returns: if it returned these already, "
                "keep using what it returned, or pass the model's original float32 variables "
                "through initialize once.")
    raise ValueError(f"{where} is {dtype}: jamp.initialize takes float32 models (the float32 "
                     f"variables model.init returns), as Apex's float32 check does: no cast "
                     f"to half before initialize. {hint}")


def cast_floating(tree: Any, dtype: Any) -> Any:
    """Apex's cast of a model's inputs and outputs: floating JAX arrays to `dtype`, objects
    with a `to(dtype)` method through it, containers recursively; integer arrays, numpy
    arrays and Python numbers pass through uncast (as Apex forwards numpy arrays). `tree` is
    returned unchanged when `dtype` is None."""
    if dtype is None:
        return tree

    def is_custom(x):
        return callable(getattr(x, "to", None)) and not isinstance(x, (jax.Array, np.ndarray))

    def cast(x):
        if is_custom(x):
            return x.to(dtype)
        if isinstance(x, jax.Array) and is_floating(x):
            return x.astype(dtype)
        return x

    return jax.tree_util.tree_map(cast, tree, is_leaf=is_custom)


__all__ = ["cast_floating", "check_float32"]
