"""fp8 in autocast: the products of a module a precision rule sets to an fp8 recipe.

A rule `(pattern, jamp.fp8.recipe(name))` (or `jamp.autocast(fn, dtype=recipe)`) puts the
region's linear layers through `jamp.fp8`: a `dot_general` without batch dimensions or a
convolution whose right operand is a weight (`autocast_facts.Kernels.is_linear_layer`, the
facts that tell torch's `linear` from attention's score matmuls), whatever module class
wrote it (linen's and NNX's Dense, DenseGeneral, Einsum, Conv). Products of two activations
run in the region's dtype, unless a function rule set the recipe (`Region.fp8_every`).

The input enters the float8 cast in the region's dtype (autocast's cast of an activation, as
torchao's Float8Linear casts its input to the autocast dtype), the weight in its own dtype
(its scale comes from the float32 master); the result comes back in the region's dtype and
the gradients in the operands' dtypes (`jamp.fp8.dot_general`).

A `jax.grad` inside the traced function puts its backward pass in the jaxpr as plain
products (the output gradient times the kernel, the input times the output gradient), which
no fact tells apart as a layer's grad_input and grad_weight GEMMs: they run in the region's
dtype, as jax traced them, not through the recipe. The recipe's backward GEMMs come from
differentiating the transformed function (`jamp.fp8.dot_general`'s custom_vjp).
"""

from __future__ import annotations

import math
import warnings
from typing import Callable, Sequence

import jax

from jamp import fp8
from jamp.transforms.autocast_rules import Region

PRODUCTS = frozenset({"dot_general", "conv_general_dilated"})
# XLA's float8 GEMMs on GPUs (cuBLASLt) need the weight's dimensions multiples of 16; a
# product they cannot take runs the float8 numerics at high-precision speed.
GEMM_MULTIPLE = 16


def runs_in_fp8(eqn, region: Region, is_linear_layer: Callable[[], bool]) -> bool:
    """Whether `eqn` runs through `jamp.fp8` in `region` (`is_linear_layer`: whether the
    facts say it is one, see the module docstring; asked only for a product of an fp8
    region). A product of a backward pass the traced function runs itself (its own
    `jax.grad`) does not: see the module docstring."""
    return (region.enabled and region.fp8 is not None and not region.backward
            and eqn.primitive.name in PRODUCTS and (region.fp8_every or is_linear_layer()))


def product(eqn, lhs, rhs, region: Region, path: Sequence[str],
            state: fp8.DelayedState | None = None) -> jax.Array:
    """`eqn`'s product of `lhs` (the input) and `rhs` (the weight) through `jamp.fp8` with the
    region's recipe, its result in the region's dtype; `path` names the module in the warning
    for a weight float8 GEMMs cannot serve on a GPU; `state`: the delayed recipe's (see
    `autocast_delayed`)."""
    params = eqn.params
    _check_dimensions(eqn, rhs.shape, path)
    if eqn.primitive.name == "dot_general":
        return fp8.dot_general(lhs, rhs, params["dimension_numbers"], region.fp8, state=state,
                               preferred_element_type=region.dtype,
                               out_sharding=params.get("out_sharding"))
    return fp8.conv_general_dilated(
        lhs, rhs, params["window_strides"], params["padding"], params["lhs_dilation"],
        params["rhs_dilation"], params["dimension_numbers"], params["feature_group_count"],
        params["batch_group_count"], recipe=region.fp8, state=state,
        preferred_element_type=region.dtype)


def _weight_dimensions(eqn, shape: Sequence[int]) -> tuple[int, int]:
    """The weight's (contracting, kept) sizes: a Dense kernel's (in, out), a convolution's
    (input features x window, output features)."""
    if eqn.primitive.name == "dot_general":
        (_, contracting), (_, batch) = eqn.params["dimension_numbers"]
        kept = [d for d in range(len(shape)) if d not in contracting and d not in batch]
        return (math.prod(shape[d] for d in contracting), math.prod(shape[d] for d in kept))
    spec = eqn.params["dimension_numbers"].rhs_spec
    out_features = shape[spec[0]]
    return math.prod(shape) // out_features, out_features


def _check_dimensions(eqn, shape: Sequence[int], path: Sequence[str]) -> None:
    dims = _weight_dimensions(eqn, shape)
    if all(d % GEMM_MULTIPLE == 0 for d in dims):
        return
    where = "/".join(path) or "(top level)"
    warnings.warn(
        f"fp8 layer {where!r}: its {eqn.primitive.name} has a weight of shape {tuple(shape)} "
        f"(contracting {dims[0]}, output {dims[1]}): a GPU's float8 GEMM needs multiples of "
        f"{GEMM_MULTIPLE}, so it gets the float8 rounding without the float8 speed. Pad the "
        "layer, or keep it out of the fp8 rule (a rule before it in its own dtype).",
        Fp8ShapeWarning, stacklevel=2)


class Fp8ShapeWarning(UserWarning):
    """A layer an fp8 rule selects has a weight float8 GEMMs cannot serve on a GPU."""


__all__ = ["Fp8ShapeWarning", "GEMM_MULTIPLE", "PRODUCTS", "product", "runs_in_fp8"]
