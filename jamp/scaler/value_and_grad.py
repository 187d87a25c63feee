"""The one-call path: a loss-scaled `jax.value_and_grad` (flax's `DynamicScale.value_and_grad`)."""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple, Sequence

import jax
from jax import lax

from jamp.scaler.loss_scale import all_finite, is_floating


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
      >>> step = scaled_value_and_grad(loss_fn)
      >>> loss, grads, finite, loss_scale = step(loss_scale, params, batch)
      >>> updates, opt_state = tx.update(grads, opt_state, params)
      >>> params = select_tree(finite, optax.apply_updates(params, updates), params)
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
            grads = jax.tree_util.tree_map(
                lambda g: lax.pmean(g, axis_name) if is_floating(g) else g, grads)
        finite = all_finite(grads, axis_name)
        return ScaledValueAndGrad(value, grads, finite, loss_scale.adjust(finite))

    return wrapped
