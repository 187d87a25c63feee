"""Casts to float8 and their scales: the saturating cast, torchao's amax-to-scale rule, the
cast of one operand with its scale (per tensor or per row: a GEMM divides it out of its
result) and the quantize-dequantize round trip at each granularity (mxfp8's
blocks, whose scales vary along the contraction, are restored before the GEMM).

Scales follow torchao's convention: the scale multiplies a value into the float8 range
(`q = cast(x * scale)`) and divides it back out (`x ~ q / scale`). Delayed scaling keeps
Flax's inverse convention in its own module, where its state is read and written.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jamp.fp8.recipes import MX_BLOCK_SIZE, Cast
from jamp.policy.dtypes import FLOAT32

# torchao's floor under an amax, so that an all-zero tensor gets a finite scale.
AMAX_EPS = 1e-12


def saturating_cast(x: jax.Array, dtype) -> jax.Array:
    """`x` cast to `dtype` with values beyond its finite range clamped to it first.

    A plain cast of 500.0 to float8_e4m3fn gives NaN under `jax.jit` (e4m3fn has no infinity);
    this gives 448.0. Infinities saturate to the largest finite value too; NaN stays NaN (it
    carries "this step is broken" to the loss scaler rather than hiding it as a large value).

    >>> import jax, jax.numpy as jnp
    >>> from jamp.fp8 import saturating_cast
    >>> jax.jit(saturating_cast, static_argnums=1)(jnp.array([500.0, -1e9]), jnp.float8_e4m3fn)
    Array([448, -448], dtype=float8_e4m3fn)
    """
    largest = float(jnp.finfo(dtype).max)
    return jnp.clip(x, -largest, largest).astype(dtype)


def amax_to_scale(amax: jax.Array, dtype, *, power_of_2: bool = False) -> jax.Array:
    """torchao's scale for a tensor whose largest magnitude is `amax`: float8 max / amax.

    The amax is clamped to at least 1e-12 (an all-zero tensor gets a large finite scale). With
    `power_of_2`, the scale is rounded down to a power of two, as torchao computes it
    (`exp2(floor(log2(scale)))`), so scaling loses no mantissa bits.
    """
    largest = float(jnp.finfo(dtype).max)
    scale = largest / jnp.maximum(amax.astype(FLOAT32), AMAX_EPS)
    if power_of_2:
        scale = jnp.exp2(jnp.floor(jnp.log2(scale)))
    return scale


def quantize(x: jax.Array, cast: Cast, axes: Sequence[int], power_of_2: bool = False
             ) -> tuple[jax.Array, jax.Array]:
    """`x` cast to float8 as `cast` ("tensor" or "row") says, and its scale.

    Args:
      x: the operand.
      cast: its float8 dtype and granularity.
      axes: the GEMM's contracting dimensions of `x`, along which "row" scales.
      power_of_2: round the scales down to powers of two (torchao's option).

    Returns:
      The float8 values `q` and the float32 scale, `x ~ q / scale`, of `x`'s rank with size
      1 along `axes` ("row") or along every dimension ("tensor").
    """
    x32 = x.astype(FLOAT32)
    reduce = None if cast.granularity == "tensor" else tuple(axes)
    amax = jnp.max(jnp.abs(x32), axis=reduce, keepdims=True)
    scale = amax_to_scale(amax, cast.dtype, power_of_2=power_of_2)
    return saturating_cast(x32 * scale, cast.dtype), scale


def quantize_dequantize(x: jax.Array, cast: Cast, axes: Sequence[int],
                        power_of_2: bool = False) -> jax.Array:
    """`x` cast to float8 as `cast` says and back, in float32: the values a float8 GEMM sees.

    Args:
      x: the operand.
      cast: its dtype and granularity (a None dtype returns `x` in float32 unchanged).
      axes: the GEMM's contracting dimensions of `x`, along which "row" and "block" scale.
      power_of_2: round current scales down to powers of two (torchao's option).
    """
    x32 = x.astype(FLOAT32)
    if cast.dtype is None:
        return x32
    if cast.granularity == "block":
        return _block_quantize_dequantize(x32, cast.dtype, tuple(axes))
    q, scale = quantize(x32, cast, axes, power_of_2)
    return q.astype(FLOAT32) / scale


def _block_quantize_dequantize(x: jax.Array, dtype: np.dtype, axes: tuple[int, ...]
                               ) -> jax.Array:
    """mxfp8's round trip: blocks of 32 along the flattened contracting dimensions (zero
    padded to a multiple of 32: zeros leave a block's amax as it is), each with the smallest
    power-of-two scale that brings its amax within float8's range (NVIDIA's rounding up of
    amax / max, which `jax.nn.scaled_dot_general` uses too: nothing saturates)."""
    kept = [d for d in range(x.ndim) if d not in axes]
    moved = jnp.transpose(x, kept + list(axes))
    kept_shape = moved.shape[:len(kept)]
    rows = moved.reshape(kept_shape + (-1,))
    length = rows.shape[-1]
    padded = -(-length // MX_BLOCK_SIZE) * MX_BLOCK_SIZE
    rows = jnp.pad(rows, [(0, 0)] * len(kept) + [(0, padded - length)])
    blocks = rows.reshape(kept_shape + (padded // MX_BLOCK_SIZE, MX_BLOCK_SIZE))
    amax = jnp.max(jnp.abs(blocks), axis=-1, keepdims=True)
    mantissa, exponent = jnp.frexp(amax / float(jnp.finfo(dtype).max))
    # frexp gives m in [0.5, 1): the power of two at or above m * 2**e is 2**e, or 2**(e-1)
    # when m is exactly 0.5.
    exponent = jnp.where(mantissa == 0.5, exponent - 1, exponent)
    scale = jnp.where(amax > 0, jnp.ldexp(jnp.ones_like(amax), exponent), 1.0)
    restored = saturating_cast(blocks / scale, dtype).astype(FLOAT32) * scale
    restored = restored.reshape(kept_shape + (padded,))[..., :length]
    restored = restored.reshape(moved.shape)
    return jnp.transpose(restored, [int(d) for d in np.argsort(kept + list(axes))])


__all__ = ["AMAX_EPS", "amax_to_scale", "quantize", "quantize_dequantize", "saturating_cast"]
