"""The bilinear products fp8 runs on float8 values (a `dot_general` or a convolution), and the
bookkeeping of which dimensions each of a layer's three GEMMs contracts: what row and block
scales reduce over. Shared by the stateless and the delayed recipes.

A product is a frozen, hashable description (a static argument of the custom_vjp): called on
two operands (float8 values, or float32 ones) it gives their float32 product at full precision;
its two gradient GEMMs are its transposes with respect to each operand. `Kept` says where each
GEMM operand's kept (not contracted) dimensions land in that GEMM's result: a row scale, one
value per kept index, multiplies the result there (the scales factor out of the sum).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
from jax import lax

from jamp.policy.dtypes import FLOAT32


@dataclasses.dataclass(frozen=True)
class Axes:
    """The contracting dimensions of each operand of the three GEMMs.

    Attributes:
      lhs, rhs: of the output GEMM's operands.
      grad_for_lhs, rhs_for_lhs: of the grad_lhs GEMM's (the output gradient and `rhs`).
      lhs_for_rhs, grad_for_rhs: of the grad_rhs GEMM's (`lhs` and the output gradient).
    """

    lhs: tuple[int, ...]
    rhs: tuple[int, ...]
    grad_for_lhs: tuple[int, ...]
    rhs_for_lhs: tuple[int, ...]
    lhs_for_rhs: tuple[int, ...]
    grad_for_rhs: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Kept:
    """For each operand of the three GEMMs (named as in `Axes`), its kept dimensions and the
    dimension of the GEMM's result each one becomes, as `(operand dim, result dim)` pairs."""

    lhs: tuple[tuple[int, int], ...]
    rhs: tuple[tuple[int, int], ...]
    grad_for_lhs: tuple[tuple[int, int], ...]
    rhs_for_lhs: tuple[tuple[int, int], ...]
    lhs_for_rhs: tuple[tuple[int, int], ...]
    grad_for_rhs: tuple[tuple[int, int], ...]


class Product:
    """A bilinear product of `lhs` and `rhs` with a float32 result."""

    def __call__(self, lhs: jax.Array, rhs: jax.Array) -> jax.Array:
        raise NotImplementedError

    def axes(self, lhs_ndim: int, rhs_ndim: int) -> Axes:
        """The contracting dimensions of the three GEMMs' operands."""
        raise NotImplementedError

    def kept(self, lhs_ndim: int, rhs_ndim: int) -> Kept | None:
        """Where the three GEMMs' operands' kept dimensions land in their results; None where
        a row scale does not factor out of some GEMM's sum."""
        raise NotImplementedError

    def grad_lhs(self, g: jax.Array, rhs: jax.Array, lhs_shape: Sequence[int]) -> jax.Array:
        """The grad_lhs GEMM: the product's transpose in `lhs`, applied to `g`."""
        raise NotImplementedError

    def grad_rhs(self, lhs: jax.Array, g: jax.Array, rhs_shape: Sequence[int]) -> jax.Array:
        """The grad_rhs GEMM: the product's transpose in `rhs`, applied to `g`."""
        raise NotImplementedError


def _others(ndim: int, *excluded: Sequence[int]) -> tuple[int, ...]:
    return tuple(d for d in range(ndim) if not any(d in group for group in excluded))


@dataclasses.dataclass(frozen=True)
class DotProduct(Product):
    """`lax.dot_general` with `dimension_numbers` (and `out_sharding`, for the output GEMM)."""

    dimension_numbers: tuple[tuple[tuple[int, ...], tuple[int, ...]],
                             tuple[tuple[int, ...], tuple[int, ...]]]
    out_sharding: Any = None

    @classmethod
    def of(cls, dimension_numbers: Any, out_sharding: Any = None) -> DotProduct:
        """From `lax.dot_general`'s arguments, made hashable."""
        (lc, rc), (lb, rb) = dimension_numbers
        as_tuple = lambda dims: tuple(int(d) for d in dims)  # noqa: E731
        return cls(((as_tuple(lc), as_tuple(rc)), (as_tuple(lb), as_tuple(rb))), out_sharding)

    def __call__(self, lhs, rhs):
        # Two float8 operands (of one float8 dtype or two) go into the dot as they are, the
        # form XLA's float8 GEMMs take.
        return lax.dot_general(lhs, rhs, self.dimension_numbers,
                               precision=lax.Precision.HIGHEST, preferred_element_type=FLOAT32,
                               out_sharding=self.out_sharding)

    def _dims(self, lhs_ndim, rhs_ndim):
        (lc, rc), (lb, rb) = self.dimension_numbers
        lhs_free, rhs_free = _others(lhs_ndim, lc, lb), _others(rhs_ndim, rc, rb)
        # The output's dimensions: batch, then lhs's free ones, then rhs's free ones.
        batch = tuple(range(len(lb)))
        out_lhs_free = tuple(range(len(lb), len(lb) + len(lhs_free)))
        out_rhs_free = tuple(range(len(lb) + len(lhs_free),
                                   len(lb) + len(lhs_free) + len(rhs_free)))
        return lc, rc, lb, rb, lhs_free, rhs_free, batch, out_lhs_free, out_rhs_free

    def axes(self, lhs_ndim, rhs_ndim):
        lc, rc, _, _, lhs_free, rhs_free, _, out_lhs_free, out_rhs_free = self._dims(
            lhs_ndim, rhs_ndim)
        return Axes(lc, rc, out_rhs_free, rhs_free, lhs_free, out_lhs_free)

    def kept(self, lhs_ndim, rhs_ndim):
        lc, rc, lb, rb, lhs_free, rhs_free, batch, out_lhs_free, out_rhs_free = self._dims(
            lhs_ndim, rhs_ndim)
        pairs = lambda *groups: tuple(  # noqa: E731
            p for src, dst in groups for p in zip(src, dst))
        return Kept(lhs=pairs((lb, batch), (lhs_free, out_lhs_free)),
                    rhs=pairs((rb, batch), (rhs_free, out_rhs_free)),
                    grad_for_lhs=pairs((batch, lb), (out_lhs_free, lhs_free)),
                    rhs_for_lhs=pairs((rb, lb), (rc, lc)),
                    lhs_for_rhs=pairs((lb, rb), (lc, rc)),
                    grad_for_rhs=pairs((batch, rb), (out_rhs_free, rhs_free)))

    def grad_lhs(self, g, rhs, lhs_shape):
        lc, rc, lb, rb, _, rhs_free, batch, out_lhs_free, out_rhs_free = self._dims(
            len(lhs_shape), rhs.ndim)
        # Result: batch, lhs's free dims, then rhs's contracting dims in rhs's order.
        out = lax.dot_general(g, rhs, ((out_rhs_free, rhs_free), (batch, rb)),
                              precision=lax.Precision.HIGHEST, preferred_element_type=FLOAT32)
        return _to_layout(out, lb, _others(len(lhs_shape), lc, lb), _in_order_of(lc, rc))

    def grad_rhs(self, lhs, g, rhs_shape):
        lc, rc, lb, rb, lhs_free, _, batch, out_lhs_free, _ = self._dims(lhs.ndim, len(rhs_shape))
        # Result: batch, lhs's contracting dims in lhs's order, then rhs's free dims.
        out = lax.dot_general(lhs, g, ((lhs_free, out_lhs_free), (lb, batch)),
                              precision=lax.Precision.HIGHEST, preferred_element_type=FLOAT32)
        return _to_layout(out, rb, _in_order_of(rc, lc), _others(len(rhs_shape), rc, rb))


def _in_order_of(dims: Sequence[int], other: Sequence[int]) -> tuple[int, ...]:
    """`dims` (paired with `other`) ordered as their partners in `other` are sorted."""
    return tuple(d for _, d in sorted(zip(other, dims)))


def _to_layout(out: jax.Array, *groups: Sequence[int]) -> jax.Array:
    """`out`, whose dimensions are those of `groups` in turn, transposed into the order of
    the dimensions the groups name (the operand's layout)."""
    order = [d for group in groups for d in group]
    return lax.transpose(out, tuple(order.index(d) for d in range(len(order))))


@dataclasses.dataclass(frozen=True)
class ConvProduct(Product):
    """`lax.conv_general_dilated` with its (canonical, hashable) parameters."""

    window_strides: tuple[int, ...]
    padding: tuple[tuple[int, int], ...]
    lhs_dilation: tuple[int, ...]
    rhs_dilation: tuple[int, ...]
    dimension_numbers: lax.ConvDimensionNumbers
    feature_group_count: int = 1
    batch_group_count: int = 1
    out_sharding: Any = None

    def __call__(self, lhs, rhs):
        # A convolution takes one dtype for both operands: float8 values of two dtypes (e5m2
        # and e4m3) are widened, exactly, to float32.
        if lhs.dtype != rhs.dtype:
            lhs, rhs = lhs.astype(FLOAT32), rhs.astype(FLOAT32)
        return lax.conv_general_dilated(
            lhs, rhs, self.window_strides, self.padding, self.lhs_dilation, self.rhs_dilation,
            self.dimension_numbers, self.feature_group_count, self.batch_group_count,
            precision=lax.Precision.HIGHEST, preferred_element_type=FLOAT32,
            out_sharding=self.out_sharding)

    def axes(self, lhs_ndim, rhs_ndim):
        # A convolution contracts the input features and the window: the output GEMM over
        # lhs's features and space and rhs's input features and window; grad_lhs over the
        # output's features and space and rhs's output features and window; grad_rhs over
        # the batch and space of lhs and of the output.
        lhs_spec, rhs_spec, out_spec = self.dimension_numbers
        return Axes(lhs=tuple(lhs_spec[1:]), rhs=tuple(rhs_spec[1:]),
                    grad_for_lhs=tuple(out_spec[1:]),
                    rhs_for_lhs=(rhs_spec[0],) + tuple(rhs_spec[2:]),
                    lhs_for_rhs=(lhs_spec[0],) + tuple(lhs_spec[2:]),
                    grad_for_rhs=(out_spec[0],) + tuple(out_spec[2:]))

    def kept(self, lhs_ndim, rhs_ndim):
        if self.feature_group_count > 1 or self.batch_group_count > 1:
            # A group's slice of the features meets one group of the other operand's: the
            # row scales do not factor out of the gradient GEMMs' sums.
            return None
        (lb, lf, *_), (ro, ri, *_), (ob, of, *_) = self.dimension_numbers
        return Kept(lhs=((lb, ob),), rhs=((ro, of),), grad_for_lhs=((ob, lb),),
                    rhs_for_lhs=((ri, lf),), lhs_for_rhs=((lf, ri),), grad_for_rhs=((of, ro),))

    # The gradient GEMMs are lax's transposes of the convolution, on float32 operands (the
    # transposes take the cotangent's dtype: float8 values are widened, exactly).
    def grad_lhs(self, g, rhs, lhs_shape):
        shape = jax.ShapeDtypeStruct(tuple(lhs_shape), FLOAT32)
        rhs = rhs.astype(FLOAT32)
        return jax.linear_transpose(lambda x: self(x, rhs), shape)(g.astype(FLOAT32))[0]

    def grad_rhs(self, lhs, g, rhs_shape):
        shape = jax.ShapeDtypeStruct(tuple(rhs_shape), FLOAT32)
        lhs = lhs.astype(FLOAT32)
        return jax.linear_transpose(lambda w: self(lhs, w), shape)(g.astype(FLOAT32))[0]


__all__ = ["Axes", "ConvProduct", "DotProduct", "Kept", "Product"]
