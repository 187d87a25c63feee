"""The one-call path: a loss-scaled `jax.value_and_grad` for any jamp loss scale.

It returns `(value, grads, finite, loss_scale)`, a different order and content from flax's
`DynamicScale.value_and_grad` (`(dynamic_scale, finite, aux, grad)`); code written against
flax uses `jamp.DynamicScale`, which is flax's API.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple, Sequence

import jax
from jax import lax

from jamp.scaler.loss_scale import all_finite, map_inexact


class ScaledValueAndGrad(NamedTuple):
    """What a `scaled_value_and_grad` function returns.

    Attributes:
      value: the loss as `fun` returned it, unscaled (with `has_aux`, `(loss, aux)`).
      grads: the unscaled grads (averaged over `axis_name` when given).
      finite: scalar bool, whether every floating leaf of `grads` is finite.
      loss_scale: the loss scale adjusted to `finite`, for the next step.
    """

    value: Any
    grads: Any
    finite: jax.Array
    loss_scale: Any


def scaled_value_and_grad(
    fun: Callable[..., Any],
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
    axis_name: Any = None,
) -> Callable[..., ScaledValueAndGrad]:
    """`jax.value_and_grad` with loss scaling: scale the loss, unscale and check the grads.

    Args:
      fun: the loss function; its output (or first output with `has_aux`) is a real scalar.
      argnums: which positional arguments of `fun` to differentiate.
      has_aux: `fun` returns `(loss, aux)`.
      axis_name: a shard_map/pmap axis: grads are averaged over it (`lax.pmean`) and all
        replicas agree on `finite`. (Under `jax.shard_map`, grads of parameters that are
        replicated across the axis come back from JAX already summed over it; the pmean
        leaves such grads as they are.)

    Returns:
      A function `(loss_scale, *args, **kwargs) -> ScaledValueAndGrad`, where `loss_scale` is
      any jamp loss scale (`DynamicLossScale`, `GradScalerState`, ...).

    Example:
      >>> import jax.numpy as jnp, jamp
      >>> loss_fn = lambda params, x: jnp.sum((params * x) ** 2)
      >>> params, x = jnp.array([1.0, 2.0]), jnp.array([3.0, 0.5])
      >>> step = jamp.scaled_value_and_grad(loss_fn)
      >>> loss, grads, finite, loss_scale = step(jamp.GradScaler().init(), params, x)
      >>> params = jamp.select_tree(finite, params - 0.01 * grads, params)
      >>> loss, grads, bool(finite)
      (Array(10., dtype=float32), Array([18.,  1.], dtype=float32), True)
    """

    def scaled(loss_scale, *args, **kwargs):
        out = fun(*args, **kwargs)
        loss = out[0] if has_aux else out
        return loss_scale.scale(loss), out

    @functools.wraps(fun)
    def wrapped(loss_scale, *args, **kwargs) -> ScaledValueAndGrad:
        grad_fn = jax.value_and_grad(
            functools.partial(scaled, loss_scale), argnums=argnums, has_aux=True)
        (_, value), grads = grad_fn(*args, **kwargs)
        grads = loss_scale.unscale(grads)
        if axis_name is not None:
            grads = map_inexact(lambda g: lax.pmean(g, axis_name), grads)
        finite = all_finite(grads, axis_name)
        return ScaledValueAndGrad(value, grads, finite, loss_scale.adjust(finite))

    return wrapped


__all__ = ["scaled_value_and_grad", "ScaledValueAndGrad"]
