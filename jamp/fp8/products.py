"""The bilinear products fp8 runs on float8 values (a `dot_general` or a convolution), and the
bookkeeping of which dimensions each of a layer's three GEMMs contracts: what row and block
scales reduce over. Shared by the stateless and the delayed recipes.

A product is a frozen, hashable description (a static argument of the custom_vjp): called on
two float32 operands it gives their float32 product at full precision; its two gradient GEMMs
are its transposes with respect to each operand.
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


class Product:
    """A bilinear product of `lhs` and `rhs` in float32."""

    def __call__(self, lhs: jax.Array, rhs: jax.Array) -> jax.Array:
        raise NotImplementedError

    def axes(self, lhs_ndim: int, rhs_ndim: int) -> Axes:
        """The contracting dimensions of the three GEMMs' operands."""
        raise NotImplementedError

    def grad_lhs(self, g: jax.Array, rhs: jax.Array, lhs_shape: Sequence[int]) -> jax.Array:
        """The grad_lhs GEMM: the product's transpose in `lhs`, applied to `g`."""
        shape = jax.ShapeDtypeStruct(tuple(lhs_shape), FLOAT32)
        return jax.linear_transpose(lambda x: self(x, rhs), shape)(g)[0]

    def grad_rhs(self, lhs: jax.Array, g: jax.Array, rhs_shape: Sequence[int]) -> jax.Array:
        """The grad_rhs GEMM: the product's transpose in `rhs`, applied to `g`."""
        shape = jax.ShapeDtypeStruct(tuple(rhs_shape), FLOAT32)
        return jax.linear_transpose(lambda w: self(lhs, w), shape)(g)[0]


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
        return lax.dot_general(lhs, rhs, self.dimension_numbers,
                               precision=lax.Precision.HIGHEST, preferred_element_type=FLOAT32,
                               out_sharding=self.out_sharding)

    def axes(self, lhs_ndim, rhs_ndim):
        (lc, rc), (lb, rb) = self.dimension_numbers
        lhs_free, rhs_free = _others(lhs_ndim, lc, lb), _others(rhs_ndim, rc, rb)
        # The output's dimensions: batch, then lhs's free ones, then rhs's free ones.
        out_lhs_free = tuple(range(len(lb), len(lb) + len(lhs_free)))
        out_rhs_free = tuple(range(len(lb) + len(lhs_free),
                                   len(lb) + len(lhs_free) + len(rhs_free)))
        return Axes(lc, rc, out_rhs_free, rhs_free, lhs_free, out_lhs_free)


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


__all__ = ["Axes", "ConvProduct", "DotProduct", "Product"]
