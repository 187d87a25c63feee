"""flax's `DynamicScale`, so that Flax training code switches to jamp by changing its import.

Same fields (static `growth_factor`, `backoff_factor`, `growth_interval`, `minimum_scale`;
leaves `fin_steps` and `scale`), the same `value_and_grad` signature and `DynamicScaleResult`,
and flax's update rule step for step:

- the loss is multiplied by `scale`; the grads come back as float32, divided by `scale`, and
  the returned value (the loss, or `(loss, aux)` with `has_aux`) is divided by it too;
- with `fin_steps == growth_interval` and finite grads the scale grows by `growth_factor`
  (capped at float32's largest value) and `fin_steps` restarts at 0; otherwise a finite step
  counts one more;
- non-finite grads multiply the scale by `backoff_factor` (not under `minimum_scale`) and
  restart `fin_steps`.

Beyond flax: `grad` (`value_and_grad` without the value), finiteness checked on floating and
complex leaves only (an int leaf in the grads is passed through instead of failing), and
settings that make no sense (a negative factor, a string interval) are refused when built.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax import lax

from jamp._checks import check_count, check_positive
from jamp.scaler.loss_scale import all_finite, map_inexact
from jamp.scaler.protocol import loss_scale_dataclass

_FLOAT32_MAX = np.float32(np.finfo(np.float32).max)


class DynamicScaleResult(NamedTuple):
    """What `DynamicScale.value_and_grad`'s function returns (flax's fields, flax's order).

    Attributes:
      dynamic_scale: the `DynamicScale` for the next step.
      finite: scalar bool, whether every grad is finite (apply the update only then).
      aux: the unscaled loss (with `has_aux`, `(loss, aux)`); None from `grad` without aux.
      grad: the unscaled grads, float32.
    """

    dynamic_scale: "DynamicScale"
    finite: jax.Array
    aux: Any
    grad: Any


@loss_scale_dataclass
class DynamicScale:
    """Dynamic loss scaling for mixed-precision grads: flax's `DynamicScale`, field for field.

    A pytree (it fits in a Flax `TrainState`) with flax's `replace`; `value_and_grad` wraps a
    loss function the way `jax.value_and_grad` does and returns a `DynamicScaleResult`. Its
    `scale` is flax's field, the current value, so it is not a `jamp.scaler.LossScale`.

    Attributes:
      growth_factor: multiplies the scale after a run of finite steps (2.0).
      backoff_factor: multiplies the scale after a non-finite step (0.5).
      growth_interval: finite steps counted before the scale grows (2000).
      fin_steps: finite steps counted so far (a leaf).
      scale: the current loss scale (a leaf, 65536.0).
      minimum_scale: the scale never backs off below this (float32's smallest normal number);
        None for no floor.

    Example:
      >>> import jax, jax.numpy as jnp, jamp
      >>> loss_fn = lambda p: jnp.sum(jnp.asarray(p, jnp.float16) * 1.5)
      >>> params = jnp.array([0.25, 0.5])
      >>> step = jax.jit(lambda ds, p: ds.value_and_grad(loss_fn)(p))
      >>> dyn_scale = jamp.DynamicScale(growth_interval=10)
      >>> for _ in range(2):  # grads of 65536 * loss overflow float16: skip, back off
      ...     dyn_scale, is_fin, loss, grad = step(dyn_scale, params)
      ...     params = jnp.where(is_fin, params - 0.1 * grad, params)
      ...     print(bool(is_fin), float(dyn_scale.scale), params)
      False 32768.0 [0.25 0.5 ]
      True 32768.0 [0.09999999 0.35      ]
    """

    growth_factor: float = struct.field(pytree_node=False, default=2.0)
    backoff_factor: float = struct.field(pytree_node=False, default=0.5)
    growth_interval: int = struct.field(pytree_node=False, default=2000)
    fin_steps: Any = 0
    scale: Any = 65536.0
    minimum_scale: float | None = struct.field(
        pytree_node=False, default=float(np.finfo(np.float32).tiny))

    def __post_init__(self):
        check_positive("growth_factor", self.growth_factor)
        check_positive("backoff_factor", self.backoff_factor)
        check_count("growth_interval", self.growth_interval, minimum=0)
        if self.minimum_scale is not None:
            check_positive("minimum_scale", self.minimum_scale, allow_zero=True)

    def replace(self, **updates: Any) -> "DynamicScale":
        """A copy with `updates` to its fields (flax's `replace`)."""
        return dataclasses.replace(self, **updates)

    def value_and_grad(
        self,
        fun: Callable[..., Any],
        argnums: int | Sequence[int] = 0,
        has_aux: bool = False,
        axis_name: Any = None,
    ) -> Callable[..., DynamicScaleResult]:
        """`jax.value_and_grad` of `fun` with the loss scaled by `self.scale`.

        Args:
          fun: the loss function; it returns a scalar (or `(scalar, aux)` with `has_aux`).
          argnums: which positional arguments to differentiate.
          has_aux: `fun` returns `(loss, aux)`.
          axis_name: a shard_map/pmap axis over which the grads are averaged (`lax.pmean`);
            not needed under `jax.jit` with sharded arrays.

        Returns:
          A function taking `fun`'s arguments and returning a `DynamicScaleResult`.
        """
        return self._differentiate(fun, argnums, has_aux, axis_name, with_value=True)

    def grad(
        self,
        fun: Callable[..., Any],
        argnums: int | Sequence[int] = 0,
        has_aux: bool = False,
        axis_name: Any = None,
    ) -> Callable[..., DynamicScaleResult]:
        """As `value_and_grad`, for code that does not need the loss: `aux` is `fun`'s aux
        output with `has_aux`, else None."""
        return self._differentiate(fun, argnums, has_aux, axis_name, with_value=False)

    def _differentiate(self, fun, argnums, has_aux, axis_name, with_value):
        def scaled(*args, **kwargs):
            out = fun(*args, **kwargs)
            if has_aux:
                return self.scale * out[0], out[1]
            return self.scale * out

        grad_fn = jax.value_and_grad(scaled, argnums, has_aux)

        @functools.wraps(fun)
        def wrapped(*args, **kwargs) -> DynamicScaleResult:
            value, grad = grad_fn(*args, **kwargs)
            if has_aux:
                aux = (value[0] / self.scale, value[1]) if with_value else value[1]
            else:
                aux = value / self.scale if with_value else None
            grad = map_inexact(lambda g: jnp.asarray(g, jnp.float32) / self.scale, grad)
            if axis_name is not None:
                grad = map_inexact(lambda g: lax.pmean(g, axis_name), grad)
            finite = all_finite(grad)
            return DynamicScaleResult(self._next(finite), finite, aux, grad)

        return wrapped

    def _next(self, finite: jax.Array) -> "DynamicScale":
        """The state after a step whose grads were `finite` (flax's rule)."""
        grow = self.fin_steps == self.growth_interval
        grown = jnp.minimum(self.scale * self.growth_factor, _FLOAT32_MAX)
        on_finite = jnp.where(grow & finite, grown, self.scale)
        on_overflow = self.scale * self.backoff_factor
        if self.minimum_scale is not None:
            on_overflow = jnp.maximum(on_overflow, self.minimum_scale)
        return self.replace(
            fin_steps=jnp.where(grow | ~finite, 0, self.fin_steps + 1),
            scale=jnp.where(finite, on_finite, on_overflow))


__all__ = ["DynamicScale", "DynamicScaleResult"]
