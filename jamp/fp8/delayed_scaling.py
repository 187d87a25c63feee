"""Delayed scaling (Transformer Engine's `DelayedScaling`, Flax's `fp8_ops`): each of a GEMM's
three tensors (input, kernel, output gradient) is scaled by a factor computed from the amaxes
of earlier steps, held in a state the caller threads through the training step.

Design: the state of one GEMM is a `DelayedState` pytree (a NamedTuple of float32 arrays, with
Flax's field names and shapes: scales of shape (1,), amax histories of shape (length,)). It
goes into `jamp.fp8.dot_general(..., state=state)` as an argument and **the next state is the
gradient with respect to it**: differentiate the step with respect to `(params, state)` and
use the state's "gradient" as the new state. This is Flax's OVERWRITE_WITH_GRADIENT mechanism,
chosen for a reason that no explicit output avoids: the output gradient's amax exists only in
the backward pass, so a forward output cannot carry it, and a GEMM's new state is complete only
once its backward pass has run. The cotangent route delivers all six fields at once, in the
jitted step, with nothing outside the program. A call evaluated without differentiation (an
evaluation step) reads the state and updates nothing.

Consequences for callers: one state per GEMM call site and step (two calls on one state, or
gradient accumulation over micro-batches, would add the new states together); under `jax.vmap`
map the state with the operands (`in_axes=0` on both) or keep it unmapped (then the
mapped elements' new states are summed, so map it); under `nn.scan` over layers, stack one
state per layer, as Flax's variables are. Under `jamp.autocast` with a delayed rule,
`jamp.fp8.init_autocast_state` and `with_state` keep these books (`jamp.fp8.autocast_state`).

Numerics, as Flax's `Fp8DotGeneralOp`:

- the scale is stored inverted (Flax's and TE's `scale_inv`: amax / float8 max): a value is
  quantized as `cast(clip(x / scale))` and restored as `q * scale`;
- the scale used at a step comes from the history *before* that step's amax enters it:
  `max` over the whole history, or its newest entry (`most_recent`), multiplied by
  `2 ** margin`; an amax of 0 or a non-finite one keeps the previous scale;
- the history then rolls by one and takes the tensor's current amax at index 0.

A fresh state (scales 1, histories 0) therefore quantizes the first step at scale 1: values
beyond float8's range saturate (Flax, TE and Keras do the same; jamp follows them for
parity). The quantize runs in float32 (Flax runs it in the kernel's dtype: the same for
float32 kernels). Each GEMM takes the float8 values and multiplies its float32 result by the
two scales (Flax multiplies each operand by its scale before the GEMM: the results differ by
float32 rounding).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jamp.fp8.casts import saturating_cast
from jamp.fp8.products import Product
from jamp.fp8.recipes import Recipe, check_recipe
from jamp.policy.dtypes import FLOAT32


class DelayedState(NamedTuple):
    """The delayed-scaling state of one GEMM (Flax's `Fp8DotGeneralOp` variables).

    Attributes:
      input_scale, kernel_scale, output_grad_scale: shape (1,), float32: the dequantization
        scales last used (amax / float8 max).
      input_amax_history, kernel_amax_history, output_grad_amax_history: shape (length,),
        float32: the amaxes of the last `length` steps, newest at index 0.
    """

    input_scale: jax.Array
    kernel_scale: jax.Array
    output_grad_scale: jax.Array
    input_amax_history: jax.Array
    kernel_amax_history: jax.Array
    output_grad_amax_history: jax.Array


def init_delayed_state(recipe: Recipe) -> DelayedState:
    """A fresh state for one GEMM under the delayed `recipe`: scales 1, histories of zeros.

    >>> import jamp
    >>> state = jamp.fp8.init_delayed_state(jamp.fp8.recipe("delayed", amax_history_length=4))
    >>> state.input_amax_history.shape, state.input_scale.shape
    ((4,), (1,))
    """
    recipe = _check_delayed(recipe)
    length = recipe.option("amax_history_length")
    # Six distinct buffers, so that a step may donate the state.
    scales = [jnp.ones((1,), FLOAT32) for _ in range(3)]
    histories = [jnp.zeros((length,), FLOAT32) for _ in range(3)]
    return DelayedState(*scales, *histories)


def scale_from_history(amax_history: jax.Array, scale: jax.Array, dtype, recipe: Recipe
                       ) -> jax.Array:
    """The dequantization scale for this step from the amaxes of earlier ones.

    Args:
      amax_history: the history before this step's amax enters it (newest at index 0).
      scale: the previous scale, kept when the history's amax is 0 or not finite.
      dtype: the float8 dtype the tensor is cast to.
      recipe: a delayed recipe (its `amax_compute_algo` and `margin`).
    """
    if recipe.option("amax_compute_algo") == "max":
        amax = jnp.max(amax_history, axis=0)
    else:
        amax = amax_history[0]
    previous = 1.0 / scale
    # Flax's arithmetic, step for step, so that scales agree to the bit.
    factor = (float(jnp.finfo(dtype).max) / amax) / (2.0 ** recipe.option("margin"))
    factor = jnp.where(amax > 0.0, factor, previous)
    factor = jnp.where(jnp.isfinite(amax), factor, previous)
    return 1.0 / factor


def update_amax_history(amax_history: jax.Array, x: jax.Array) -> jax.Array:
    """The history after a step on `x`: rolled by one, `x`'s amax at index 0."""
    amax = jnp.max(jnp.abs(x)).astype(amax_history.dtype)
    return jnp.roll(amax_history, -1, axis=0).at[0].set(amax)


def _step(x: jax.Array, dtype, scale: jax.Array, history: jax.Array, recipe: Recipe
          ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`x` cast to float8 at the delayed scale (`x ~ q * scale`), the new scale and history."""
    new_scale = scale_from_history(history, scale, dtype, recipe)
    x32 = x.astype(FLOAT32)
    return (saturating_cast(x32 / new_scale, dtype), new_scale,
            update_amax_history(history, x32))


def _unscaled(out: jax.Array, *scales: jax.Array) -> jax.Array:
    """A GEMM's float32 result on float8 operands times their (shape (1,)) scales."""
    factor = scales[0].reshape(())
    for scale in scales[1:]:
        factor = factor * scale.reshape(())
    return out * factor


def product(lhs: jax.Array, rhs: jax.Array, product: Product, recipe: Recipe,
            state: DelayedState, out_dtype: np.dtype) -> jax.Array:
    """The delayed-scaling `product` of `lhs` and `rhs` (what `jamp.fp8.dot_general` and
    `jamp.fp8.conv_general_dilated` run with the delayed recipe)."""
    if not isinstance(state, DelayedState):
        raise TypeError(f"state must be a jamp.fp8.DelayedState (from "
                        f"jamp.fp8.init_delayed_state), got {type(state).__name__}.")
    length = recipe.option("amax_history_length")
    shapes = {field: np.shape(value) for field, value in state._asdict().items()}
    expected = {field: (length,) if field.endswith("history") else (1,) for field in shapes}
    if shapes != expected:
        raise ValueError(f"The delayed state does not fit {recipe!r}: its shapes are {shapes}, "
                         f"expected {expected}.")
    dtypes = (np.dtype(lhs.dtype), np.dtype(rhs.dtype), out_dtype)
    return _delayed(lhs, rhs, state, product, recipe, dtypes)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _delayed(lhs, rhs, state, product, recipe, dtypes):
    return _delayed_fwd(lhs, rhs, state, product, recipe, dtypes)[0]


def _delayed_fwd(lhs, rhs, state, product, recipe, dtypes):
    casts = recipe.gemms.output
    lhs8, input_scale, input_history = _step(lhs, casts.lhs.dtype, state.input_scale,
                                             state.input_amax_history, recipe)
    rhs8, kernel_scale, kernel_history = _step(rhs, casts.rhs.dtype, state.kernel_scale,
                                               state.kernel_amax_history, recipe)
    out = _unscaled(product(lhs8, rhs8), input_scale, kernel_scale).astype(dtypes[2])
    partial_state = state._replace(input_scale=input_scale, kernel_scale=kernel_scale,
                                   input_amax_history=input_history,
                                   kernel_amax_history=kernel_history)
    # The gradient GEMMs reuse the forward's float8 operands (one cast per tensor per step),
    # saved as float8: a quarter of float32's bytes.
    return out, (lhs8, rhs8, partial_state)


def _delayed_bwd(product, recipe, dtypes, residuals, g):
    lhs8, rhs8, partial_state = residuals
    lhs_dtype, rhs_dtype, _ = dtypes
    g8, grad_scale, grad_history = _step(g, recipe.gemms.grad_lhs.lhs.dtype,
                                         partial_state.output_grad_scale,
                                         partial_state.output_grad_amax_history, recipe)
    new_state = partial_state._replace(output_grad_scale=grad_scale,
                                       output_grad_amax_history=grad_history)
    d_lhs = _unscaled(product.grad_lhs(g8, rhs8, lhs8.shape), grad_scale,
                      partial_state.kernel_scale)
    d_rhs = _unscaled(product.grad_rhs(lhs8, g8, rhs8.shape), partial_state.input_scale,
                      grad_scale)
    return d_lhs.astype(lhs_dtype), d_rhs.astype(rhs_dtype), new_state


_delayed.defvjp(_delayed_fwd, _delayed_bwd)


def _check_delayed(recipe: Recipe) -> Recipe:
    recipe = check_recipe(recipe)
    if recipe.scaling != "delayed":
        raise ValueError(f"{recipe!r} keeps no state: init_delayed_state takes "
                         "jamp.fp8.recipe(\"delayed\", ...).")
    return recipe


__all__ = ["DelayedState", "init_delayed_state", "product", "scale_from_history",
           "update_amax_history"]
