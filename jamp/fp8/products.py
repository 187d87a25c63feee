"""The float32 GEMMs that multiply float8 values, and the bookkeeping of which dimensions each
of a linear layer's three GEMMs contracts (shared by the stateless and the delayed recipes).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
from jax import lax

from jamp.policy.dtypes import FLOAT32

DimensionNumbers = tuple[tuple[tuple[int, ...], tuple[int, ...]],
                         tuple[tuple[int, ...], tuple[int, ...]]]


def canonical(dimension_numbers: Any) -> DimensionNumbers:
    """Dimension numbers as hashable tuples (a static argument of the custom_vjp)."""
    (lc, rc), (lb, rb) = dimension_numbers
    return ((tuple(map(int, lc)), tuple(map(int, rc))), (tuple(map(int, lb)), tuple(map(int, rb))))


def free_dims(ndim: int, contracting: Sequence[int], batch: Sequence[int]) -> tuple[int, ...]:
    """The dimensions of an operand that appear in the output: neither contracted nor batch."""
    return tuple(d for d in range(ndim) if d not in contracting and d not in batch)


def gemm(lhs: jax.Array, rhs: jax.Array, dims: DimensionNumbers) -> jax.Array:
    """The float32 product of two float32 operands, at full float32 precision."""
    return lax.dot_general(lhs, rhs, dims, precision=lax.Precision.HIGHEST,
                           preferred_element_type=FLOAT32)


def gradient_gemms(lhs: jax.Array, rhs: jax.Array, dims: DimensionNumbers
                   ) -> tuple[Callable, Callable]:
    """The two gradient GEMMs of `gemm(lhs, rhs, dims)`, as functions of the float32 operands
    they multiply: `grad_lhs(g, rhs)` and `grad_rhs(lhs, g)` (the transposes of the product,
    which put the result's dimensions back in the operand's order)."""
    def grad_lhs(g, rhs_):
        shape = jax.ShapeDtypeStruct(lhs.shape, FLOAT32)
        return jax.linear_transpose(lambda x: gemm(x, rhs_, dims), shape)(g)[0]

    def grad_rhs(lhs_, g):
        shape = jax.ShapeDtypeStruct(rhs.shape, FLOAT32)
        return jax.linear_transpose(lambda w: gemm(lhs_, w, dims), shape)(g)[0]

    return grad_lhs, grad_rhs


def gemm_axes(lhs_ndim: int, rhs_ndim: int, dims: DimensionNumbers) -> dict[str, tuple]:
    """The contracting dimensions of each operand of the three GEMMs: what row and block
    scales reduce over. Keys: "lhs", "rhs" (output GEMM), "grad_for_lhs", "rhs_for_lhs"
    (grad_lhs GEMM), "lhs_for_rhs", "grad_for_rhs" (grad_rhs GEMM)."""
    (lc, rc), (lb, rb) = dims
    lhs_free, rhs_free = free_dims(lhs_ndim, lc, lb), free_dims(rhs_ndim, rc, rb)
    # The output's dimensions: batch, then lhs's free ones, then rhs's free ones.
    out_lhs_free = tuple(range(len(lb), len(lb) + len(lhs_free)))
    out_rhs_free = tuple(range(len(lb) + len(lhs_free), len(lb) + len(lhs_free) + len(rhs_free)))
    return {"lhs": lc, "rhs": rc, "grad_for_lhs": out_rhs_free, "rhs_for_lhs": rhs_free,
            "lhs_for_rhs": lhs_free, "grad_for_rhs": out_lhs_free}


__all__ = ["canonical", "DimensionNumbers", "free_dims", "gemm", "gemm_axes", "gradient_gemms"]
