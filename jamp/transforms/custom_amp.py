"""`jamp.custom_fwd` / `jamp.custom_bwd`: torch's helpers for custom autograd functions, for the
fwd and bwd of a `jax.custom_vjp`.

Both only mark regions in the traced program (named scopes read by the autocast interpreter),
so outside an autocast transform they change nothing but the scope names.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
from jax import lax

from jamp.policy.autocast_tables import check_autocast_dtype
from jamp.transforms import autocast_rules as rules


def custom_fwd(fwd: Callable | None = None, *, cast_inputs: Any = None):
    """Decorates the fwd of a `jax.custom_vjp` (torch.amp.custom_fwd).

    With `cast_inputs`, inside an enabled autocast region the floating array inputs are cast
    to `cast_inputs` and the forward runs with autocast off (its ops in their inputs' types).
    With `cast_inputs=None`, the forward runs with the current autocast state. Outside an
    autocast region it is a no-op. The primal function of the custom_vjp is what runs when
    nothing is differentiated: decorate it too for the same dtypes either way.

    Example:
      >>> import jax, jax.numpy as jnp, jamp
      >>> @jax.custom_vjp
      ... def scaled_matmul(x, w):
      ...     return 2.0 * (x @ w)
      >>> def fwd(x, w):
      ...     return 2.0 * (x @ w), (x, w)
      >>> def bwd(res, g):
      ...     x, w = res
      ...     return 2.0 * (g @ w.T), 2.0 * (x.T @ g)
      >>> scaled_matmul.defvjp(jamp.custom_fwd(fwd, cast_inputs=jnp.float32),
      ...                      jamp.custom_bwd(bwd))
      >>> loss = jamp.autocast(lambda x, w: scaled_matmul(x, w).sum(), dtype=jnp.bfloat16)
      >>> jax.grad(loss, argnums=1)(jnp.ones((3, 2)), jnp.ones((2, 2)))
      Array([[6., 6.],
             [6., 6.]], dtype=float32)
    """
    if fwd is None:
        return functools.partial(custom_fwd, cast_inputs=cast_inputs)
    if cast_inputs is None:
        return fwd
    dtype = check_autocast_dtype(cast_inputs)

    @functools.wraps(fwd)
    def wrapper(*args, **kwargs):
        leaves, tree = jax.tree_util.tree_flatten((args, kwargs))
        floating = [i for i, x in enumerate(leaves)
                    if hasattr(x, "dtype") and rules.is_castable(x.dtype)]
        if floating:
            # An identity that the interpreter turns into the cast, only where autocast is on.
            with jax.named_scope(rules.marker(cast_inputs=dtype)):
                barrier = lax.optimization_barrier([leaves[i] for i in floating])
            for i, x in zip(floating, barrier, strict=True):
                leaves[i] = x
        a, kw = jax.tree_util.tree_unflatten(tree, leaves)
        with jax.named_scope(rules.marker(enabled=False, as_is=True)):
            return fwd(*a, **kw)

    wrapper._jamp_cast_inputs = dtype  # type: ignore[attr-defined]  # read by autocast
    return wrapper


def cast_inputs_of(fwd: Callable) -> Any:
    """The `cast_inputs` dtype `fwd` was decorated with by `custom_fwd`, or None."""
    return getattr(fwd, "_jamp_cast_inputs", None)


def custom_bwd(bwd: Callable) -> Callable:
    """Decorates the bwd of a `jax.custom_vjp` (torch.amp.custom_bwd): it runs with the autocast
    state of its forward. Undecorated, a bwd runs with autocast off, in the dtypes it was
    written for."""

    @functools.wraps(bwd)
    def wrapper(*args, **kwargs):
        with jax.named_scope(rules.marker(restore=True)):
            return bwd(*args, **kwargs)

    return wrapper


__all__ = ["cast_inputs_of", "custom_bwd", "custom_fwd"]
