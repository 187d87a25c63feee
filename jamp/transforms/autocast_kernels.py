"""torch kernels that autocast computes in float32 inside and rounds once at their output.

torch's low-precision kernels accumulate in float32 and round their result once: `linear` and
`addmm` add their bias to the float32 accumulator before rounding; on the CPU, `gelu`,
`softmax` and a product with a Python float compute a bfloat16 input in float32. A jaxpr
writes such a kernel as several primitives, each of which would round; the interpreter
recognizes the kernel (`autocast_dataflow.linear_kernels`, `Kernel(FP32, rounded=True)`
function rules) and computes it with the primitives here, and rounds so that XLA keeps the
rounding (`rounded`, `widened`).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax import lax

from jamp import _jax_internals as jx
from jamp.policy.dtypes import BFLOAT16, FLOAT32


def matmul_in_float32(eqn, params: dict, lhs, rhs) -> Any:
    """A matmul or convolution (`eqn`, with `params` for its low dtype result) of two low
    operands, its result accumulated and returned in float32, unrounded, for the kernel
    around it to finish and round once.

    Its derivatives are `low` products, as torch's backward kernels are: differentiated as
    written, a float32 result would make the backward's matmuls take float32 cotangents.
    """
    wide = jx.with_accumulator_dtype(params, FLOAT32)

    def product(params, a, b):
        return jx.bind(eqn, params, [a, b])[0]

    @jax.custom_jvp
    def matmul(a, b):
        return product(wide, a, b)

    def jvp(primals, tangents):
        a, b = primals
        da, db = tangents
        terms = []
        if not jx.is_symbolic_zero(da):
            terms.append(product(params, da, b))
        if not jx.is_symbolic_zero(db):
            terms.append(product(params, a, db))
        out = matmul(a, b)
        tangent = sum(terms[1:], terms[0]) if terms else jax.numpy.zeros_like(out)
        return out, tangent.astype(FLOAT32)

    matmul.defjvp(jvp, symbolic_zeros=True)
    return matmul(lhs, rhs)


# XLA allows excess precision by default (`--xla_allow_excess_precision`): it drops a pair of
# casts float32 -> low -> float32, its own (a bfloat16 matmul or elementwise op that the CPU
# computes in float32 and rounds) or autocast's, so a low value that is widened again (a
# Linear's bfloat16 output read by GELU's float32 kernel, a score matmul's read by the float32
# scaling that follows) would reach the float32 op unrounded: about a quarter of the results
# then differ from torch's, which rounds. `reduce_precision` to the low dtype's bits is an op
# XLA keeps, and a no-op on values that are already low: `rounded` puts it before a kernel's
# rounding (for the low ops that XLA widens again), `widened` after a widening. bfloat16 only:
# XLA's reduce_precision flushes float16's subnormals to zero, which loss-scaled float16
# gradients need, so float16 roundings stay as XLA leaves them.


def rounded(value, low: np.dtype) -> Any:
    """A kernel's float32 `value` rounded once to `low`, a rounding XLA keeps."""
    return lax.convert_element_type(_to_bits_of(value, low), low)


def widened(value) -> Any:
    """A low `value` widened to float32, holding the low values even where XLA dropped the
    rounding that made them."""
    return _to_bits_of(lax.convert_element_type(value, FLOAT32), value.dtype)


def _to_bits_of(value, low: np.dtype) -> Any:
    if low != BFLOAT16:
        return value
    info = jax.numpy.finfo(low)
    return lax.reduce_precision(value, exponent_bits=info.nexp, mantissa_bits=info.nmant)


def bias_in_float32(bias, shape) -> Any:
    """A layer's `bias`, already in its low dtype, broadcast to the layer's result `shape` and
    widened there to float32, for the kernel to add to its accumulator.

    Widened at the result's shape, not its own: under FSDP the partitioner gathers a sharded
    bias where the broadcast reads it, so it gathers the low values (widened first, float32
    ones). The bias's gradient is the result's float32 cotangent summed in float32 and
    rounded once, as torch's is, not a sum of rounded cotangents.
    """
    @jax.custom_jvp
    def widen(b):
        return widened(jax.numpy.broadcast_to(b, shape))

    def jvp(primals, tangents):
        (b,), (db,) = primals, tangents
        return widen(b), jax.numpy.broadcast_to(db.astype(FLOAT32), shape)

    widen.defjvp(jvp)
    return widen(bias)


__all__ = ["bias_in_float32", "matmul_in_float32", "rounded", "widened"]
