"""Casting the floating leaves of any pytree.

Only floating arrays (`jax.Array`, tracers and `numpy.ndarray`) are cast. Integer, bool and
complex arrays, Python scalars and any other leaf pass through untouched, so a tree can hold
step counters, masks, RNG keys and strings beside its parameters. float64 leaves are
floating, so they are cast like the others (jmp's rule): a policy is an explicit request.
Autocast differs here and never touches float64.

Works on every pytree a Flax user holds: dicts, `FrozenDict`, `flax.struct` dataclasses,
`nnx.State`, NamedTuples, lists and tuples.
"""

from __future__ import annotations

from typing import TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from jamp.policy.dtypes import canonical_floating_dtype, half_dtype, is_floating_array

T = TypeVar("T")


def is_numeric_array(x) -> bool:
    """True for a JAX array or tracer, or a numpy array or scalar of a numeric dtype (not an
    object, string or datetime array): what JAX can trace as an input."""
    if isinstance(x, jax.Array):
        return True
    return isinstance(x, (np.ndarray, np.generic)) and x.dtype.kind not in "OSUMm"


def cast_floating(tree: T, dtype) -> T:
    """Casts every floating array leaf of `tree` to `dtype`; other leaves are returned as is.

    numpy leaves stay numpy arrays (so a host-side data batch is not moved to the device).
    A leaf already in `dtype` is returned unchanged, without a copy or a convert op.

    Example:
      >>> import jax.numpy as jnp
      >>> from jamp.policy import cast_floating
      >>> cast_floating({"w": jnp.ones(2), "step": 3}, jnp.bfloat16)
      {'step': 3, 'w': Array([1, 1], dtype=bfloat16)}
    """
    dtype = canonical_floating_dtype(dtype)

    def cast_leaf(x):
        if is_floating_array(x) and x.dtype != dtype:
            return x.astype(dtype)
        return x

    return jax.tree_util.tree_map(cast_leaf, tree)


def cast_to_full(tree: T) -> T:
    """Casts the floating leaves of `tree` to float32."""
    return cast_floating(tree, jnp.float32)


def cast_to_half(tree: T) -> T:
    """Casts the floating leaves of `tree` to `half_dtype()` (bfloat16 on TPU, else float16)."""
    return cast_floating(tree, half_dtype())


__all__ = ["cast_floating", "cast_to_full", "cast_to_half", "is_numeric_array"]
