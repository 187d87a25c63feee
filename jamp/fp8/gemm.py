"""`jamp.fp8.dot_general` and `jamp.fp8.conv_general_dilated`: `jax.lax`'s products whose three
training GEMMs run on float8 operands, as a recipe casts them.

One `jax.custom_vjp` serves the stateless recipes (tensorwise, rowwise, rowwise_with_gw_hp,
mxfp8): the forward casts `lhs` and `rhs`, the backward casts the output gradient and
re-casts the saved high-precision operands for each gradient GEMM with that GEMM's casts, as
torchao's `matmul_with_hp_or_float8_args` does. Every GEMM takes the float8 values themselves
with a float32 accumulator and divides the scales out of its result (torch's `_scaled_mm`,
XLA's float8 GEMM rewrite), so a sharded weight is cast on its shard and gathered in float8;
mxfp8's block scales, which vary along the contraction, are divided out of the operands
before it. The result comes back in the dtype the caller asked for. Delayed scaling carries
state and lives in `jamp.fp8.delayed_scaling`.

mxfp8 runs `jax.nn.scaled_dot_general` (cuDNN's block-scaled GEMM) in a program lowered for
CUDA where its shape rules accept the operands (multiples of 32 along every GEMM's contracting
dimensions); elsewhere, and on every other platform, the emulation.

Shapes served: any `dot_general` dimension numbers (Dense, DenseGeneral, Einsum; batch
dimensions included) and any convolution. "row" and "block" scales run along each GEMM's
contracting dimensions (`jamp.fp8.products.Axes`): for a dot, the output GEMM's contracting
dimensions, for grad_lhs the dimensions `rhs` keeps, for grad_rhs the dimensions `lhs` keeps
(the flattened tokens of a Dense layer, as torchao's reshape to 2-D does). Batch dimensions are
never reduced over: each batch element has its own row scales. Under `jax.vmap` each mapped
element is scaled on its own, as if called once per element.
"""

from __future__ import annotations

import functools
import operator
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jamp import _jax_internals
from jamp.fp8 import delayed_scaling
from jamp.fp8.casts import quantize, quantize_dequantize
from jamp.fp8.products import ConvProduct, DotProduct, Product
from jamp.fp8.recipes import Gemm, Recipe, check_recipe
from jamp.policy.dtypes import is_floating


def dot_general(lhs: jax.Array, rhs: jax.Array, dimension_numbers: Any, recipe: Recipe, *,
                state: delayed_scaling.DelayedState | None = None, precision: Any = None,
                preferred_element_type: Any = None, out_sharding: Any = None) -> jax.Array:
    """`lax.dot_general(lhs, rhs, dimension_numbers)` with float8 GEMMs as `recipe` says.

    Takes `lax.dot_general`'s arguments, so a `dot_general` equation's operands and params
    pass through. `lhs` plays the input and `rhs` the weight in the recipe's casts.

    Args:
      lhs, rhs: floating operands.
      dimension_numbers: `((lhs_contracting, rhs_contracting), (lhs_batch, rhs_batch))`.
      recipe: from `jamp.fp8.recipe`.
      state: the delayed recipe's `DelayedState` (required there, refused elsewhere); its
        gradient is the next state (see `jamp.fp8.delayed_scaling`).
      precision: accepted for `lax.dot_general`'s signature and ignored: the float8 products
        always accumulate in float32.
      preferred_element_type: the result's dtype; by default the operands' result type.
      out_sharding: as `lax.dot_general`'s.

    Returns:
      The product in `preferred_element_type`; its gradients come back in the operands' own
      dtypes.
    """
    del precision
    return _run(lhs, rhs, DotProduct.of(dimension_numbers, out_sharding), recipe, state,
                preferred_element_type)


def conv_general_dilated(lhs: jax.Array, rhs: jax.Array, window_strides: Sequence[int],
                         padding: Any, lhs_dilation: Sequence[int] | None = None,
                         rhs_dilation: Sequence[int] | None = None,
                         dimension_numbers: Any = None, feature_group_count: int = 1,
                         batch_group_count: int = 1, recipe: Recipe | None = None, *,
                         state: delayed_scaling.DelayedState | None = None,
                         precision: Any = None, preferred_element_type: Any = None,
                         out_sharding: Any = None) -> jax.Array:
    """`lax.conv_general_dilated` with float8 GEMMs as `recipe` (required) says.

    Takes `lax.conv_general_dilated`'s arguments (a `conv_general_dilated` equation's params
    pass through as keywords) and `dot_general`'s `recipe`, `state`, `precision` (ignored) and
    `preferred_element_type`. Row and block scales run along the input features and the
    window (the output GEMM), the output features and the window (grad_lhs), the batch and
    space (grad_rhs); no library's recipe defines them for convolutions, this is their reading
    of "along each GEMM's contracting dimensions".
    """
    del precision
    if recipe is None:
        raise TypeError("conv_general_dilated needs recipe=jamp.fp8.recipe(name).")
    spatial = lhs.ndim - 2
    numbers = lax.conv_dimension_numbers(lhs.shape, rhs.shape, dimension_numbers)
    lhs_dilation = tuple(lhs_dilation or (1,) * spatial)
    rhs_dilation = tuple(rhs_dilation or (1,) * spatial)
    if isinstance(padding, str):
        # lax's own rule for "SAME"/"VALID": the input's spatial shape, the dilated window.
        in_shape = [lhs.shape[d] for d in numbers.lhs_spec[2:]]
        window = [(rhs.shape[d] - 1) * s + 1 for d, s in zip(numbers.rhs_spec[2:], rhs_dilation)]
        padding = lax.padtype_to_pads(in_shape, window, window_strides, padding)
    product = ConvProduct(tuple(window_strides), tuple((int(lo), int(hi)) for lo, hi in padding),
                          lhs_dilation, rhs_dilation, numbers, feature_group_count,
                          batch_group_count, out_sharding)
    return _run(lhs, rhs, product, recipe, state, preferred_element_type)


def _run(lhs, rhs, product: Product, recipe: Recipe, state, preferred_element_type):
    recipe = check_recipe(recipe)
    for name, operand in (("lhs", lhs), ("rhs", rhs)):
        if not is_floating(operand):
            raise TypeError(f"jamp.fp8 products take floating operands, got {name} of dtype "
                            f"{jnp.result_type(operand)}.")
    out_dtype = np.dtype(preferred_element_type if preferred_element_type is not None
                         else jnp.result_type(lhs, rhs))
    if recipe.scaling == "delayed":
        if state is None:
            raise TypeError("The delayed fp8 recipe needs its state: pass "
                            "state=jamp.fp8.init_delayed_state(recipe).")
        return delayed_scaling.product(lhs, rhs, product, recipe, state, out_dtype)
    if state is not None:
        raise TypeError(f"{recipe!r} keeps no state: state= is only for the delayed recipe.")
    if recipe.scaling == "block" and isinstance(product, DotProduct):
        native = _jax_internals.mxfp8_dot_general(lhs, rhs, product.dimension_numbers,
                                                  out_dtype)
        if native is not None:
            # cuDNN's block-scaled GEMM where the program is lowered for CUDA; the emulation,
            # which rounds scales the same way, everywhere else.
            return lax.platform_dependent(
                lhs, rhs, cuda=native,
                default=lambda lhs, rhs: _scaled(lhs, rhs, product, recipe, out_dtype))
    return _scaled(lhs, rhs, product, recipe, out_dtype)


def _gemm(run: Callable[[jax.Array, jax.Array], jax.Array], casts: Gemm, a: jax.Array,
          a_axes: Sequence[int], b: jax.Array, b_axes: Sequence[int],
          kept: tuple[Any, Any] | None, power_of_2: bool) -> jax.Array:
    """One GEMM, `run`, of `a` and `b` cast as `casts` says, its float32 result unscaled.

    `a_axes` and `b_axes` are the GEMM's contracting dimensions; `kept` (a pair of
    `jamp.fp8.products.Kept` fields, or None) where each operand's other dimensions land in
    the result.
    """
    operands, scales = [], []
    for x, cast, axes, pairs in ((a, casts.lhs, a_axes, kept and kept[0]),
                                 (b, casts.rhs, b_axes, kept and kept[1])):
        if cast.dtype is None or cast.granularity == "block" or (
                cast.granularity == "row" and pairs is None):
            # Kept high, or scales that vary along the contraction: restored before the GEMM.
            operands.append(quantize_dequantize(x, cast, axes, power_of_2))
            continue
        q, scale = quantize(x, cast, axes, power_of_2)
        operands.append(q)
        scales.append((scale, pairs if cast.granularity == "row" else None))
    out = run(*operands)
    if not scales:
        return out
    # The scales come out of the float32 result, as in a float8 GEMM's epilogue: per-tensor
    # ones as a scalar product, row ones as an outer product along the result's dimensions.
    # Divided by their product (exact for the scales of all-equal tensors, where multiplying
    # by rounded reciprocals is not).
    return out / functools.reduce(operator.mul, [_on_result(scale, pairs, out.ndim)
                                                 for scale, pairs in scales])


def _on_result(scale: jax.Array, pairs: Sequence[tuple[int, int]] | None, ndim: int
               ) -> jax.Array:
    """An operand's `scale` laid out against a GEMM result of rank `ndim`: a scalar for a
    per-tensor scale (`pairs` None); for a row scale (size 1 along the contracting
    dimensions), each kept dimension `d` at the result's dimension `r`, for the `(d, r)` in
    `pairs`."""
    if pairs is None:
        return scale.reshape(())
    source = sorted(d for d, _ in pairs)
    values = scale.reshape([scale.shape[d] for d in source])
    by_result = sorted(pairs, key=lambda pair: pair[1])
    values = jnp.transpose(values, [source.index(d) for d, _ in by_result])
    shape = [1] * ndim
    for d, r in pairs:
        shape[r] = scale.shape[d]
    return values.reshape(shape)


def _power_of_2(recipe: Recipe) -> bool:
    return recipe.scaling == "current" and recipe.option("round_scales_to_power_of_2")


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _scaled(lhs, rhs, product, recipe, out_dtype):
    axes, kept = product.axes(lhs.ndim, rhs.ndim), product.kept(lhs.ndim, rhs.ndim)
    out = _gemm(product, recipe.gemms.output, lhs, axes.lhs, rhs, axes.rhs,
                kept and (kept.lhs, kept.rhs), _power_of_2(recipe))
    return out.astype(out_dtype)


def _scaled_fwd(lhs, rhs, product, recipe, out_dtype):
    # The high-precision operands are saved and re-cast in the backward pass, as torchao
    # does: each gradient GEMM casts them along its own contracting dimensions.
    return _scaled(lhs, rhs, product, recipe, out_dtype), (lhs, rhs)


def _scaled_bwd(product, recipe, out_dtype, residuals, g):
    lhs, rhs = residuals
    axes, kept = product.axes(lhs.ndim, rhs.ndim), product.kept(lhs.ndim, rhs.ndim)
    power_of_2 = _power_of_2(recipe)
    d_lhs = _gemm(lambda g, rhs: product.grad_lhs(g, rhs, lhs.shape), recipe.gemms.grad_lhs,
                  g, axes.grad_for_lhs, rhs, axes.rhs_for_lhs,
                  kept and (kept.grad_for_lhs, kept.rhs_for_lhs), power_of_2)
    d_rhs = _gemm(lambda lhs, g: product.grad_rhs(lhs, g, rhs.shape), recipe.gemms.grad_rhs,
                  lhs, axes.lhs_for_rhs, g, axes.grad_for_rhs,
                  kept and (kept.lhs_for_rhs, kept.grad_for_rhs), power_of_2)
    return d_lhs.astype(lhs.dtype), d_rhs.astype(rhs.dtype)


_scaled.defvjp(_scaled_fwd, _scaled_bwd)


__all__ = ["conv_general_dilated", "dot_general"]
