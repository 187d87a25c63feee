"""The converts of a lowered (StableHLO) program, and those that primitives other than casts
lower to.

A few primitives lower to a `stablehlo.convert` of their own: `pow` with an integer exponent
converts it, a `gather` that fills out-of-bounds reads converts its indices. Which ones, and
when, is the lowering rules' business and changes between jax versions, so it is measured:
every kind of first-order equation of the program is lowered once, all together in one
program, and a program that converts is split in halves until each convert is pinned on its
equation.
"""

from __future__ import annotations

import math
import re
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jamp import _jax_internals as jx


def lowering_key(eqn) -> tuple:
    """What an equation's lowering depends on: the primitive, its params, the operand
    types and which operands are literals (with their values when they are scalars: an
    array literal, a closed-over constant, is known by its type)."""
    operands = tuple(
        (a.aval.shape, str(a.aval.dtype), getattr(a.aval, "weak_type", False),
         isinstance(a, jx.Literal) and (repr(a.val) if np.ndim(a.val) == 0 else "array"))
        for a in eqn.invars)
    return eqn.primitive.name, repr(sorted(eqn.params.items())), operands


def lowering_converts(examples: Mapping[Any, Any]) -> dict[Any, list[tuple[str, str, int]]]:
    """The `(source, target, bytes written)` of each convert that each kind of equation
    lowers to, for those that lower to any."""
    found: dict[Any, list[tuple[str, str, int]]] = {}

    def probe(keys: Sequence[Any], converts: list | None) -> None:
        # `converts`: those of `keys` lowered together; None when they cannot be (a psum
        # outside its shard_map): then the halves are tried, down to single equations.
        if converts == []:
            return
        if len(keys) == 1:
            if converts:
                found[keys[0]] = converts
            return
        first, second = keys[:len(keys) // 2], keys[len(keys) // 2:]
        in_first = _lowered_converts([examples[k] for k in first])
        everything_in_first = (converts is not None and in_first is not None
                               and len(in_first) == len(converts))
        in_second = [] if everything_in_first else _lowered_converts(
            [examples[k] for k in second])
        probe(first, in_first)
        probe(second, in_second)

    keys = list(examples)
    if keys:
        probe(keys, _lowered_converts([examples[k] for k in keys]))
    return found


def _lowered_converts(eqns: Sequence[Any]) -> list[tuple[str, str, int]] | None:
    """The converts of a program binding each of `eqns` once on inputs of their types, or
    None when it cannot be lowered."""
    specs = [jax.ShapeDtypeStruct(a.aval.shape, a.aval.dtype,
                                  weak_type=getattr(a.aval, "weak_type", False))
             for eqn in eqns for a in eqn.invars if not isinstance(a, jx.Literal)]

    def program(*arrays):
        arrays, outs = iter(arrays), []
        for eqn in eqns:
            values = [a.val if isinstance(a, jx.Literal) else next(arrays) for a in eqn.invars]
            outs += jx.bind(eqn, eqn.params, values)
        return outs

    try:
        text = jax.jit(program).lower(*specs).as_text()
    except Exception:  # noqa: BLE001 -- any lowering failure means "not on its own"
        return None
    return converts_in(text)


# `%3 = stablehlo.convert %2 : (tensor<4x8xbf16>) -> tensor<4x8xf32>`, or with one type
# when source and target are the same (`: tensor<1xi32>`).
_CONVERT_OP = re.compile(r"stablehlo\.convert\s+%[^:]*:\s*(?:\((tensor<[^>]*>)\)\s*->\s*)?"
                         r"(tensor<[^>]*>)")
_TENSOR = re.compile(r"tensor<((?:[0-9?]+x)*)(.*?)>*$")  # dimensions, element type
_MLIR_TYPES = {"i1": "bool", "bf16": "bfloat16", "f16": "float16", "f32": "float32",
               "f64": "float64", "complex<f32": "complex64", "complex<f64": "complex128"}


def _tensor_parts(text: str) -> tuple[str, str]:
    """(dims, element type) of a tensor type such as `tensor<4x8xbf16>`; the convert pattern
    only captures such types."""
    parts = _TENSOR.match(text)
    if parts is None:
        raise ValueError(f"not a tensor type: {text!r}")
    dims, element = parts.groups()
    return dims, element


def converts_in(text: str) -> list[tuple[str, str, int]]:
    """`(source dtype, target dtype, bytes written)` of each `stablehlo.convert` in `text`."""
    found = []
    for match in _CONVERT_OP.finditer(text):
        _, source_element = _tensor_parts(match.group(1) or match.group(2))
        dims, element = _tensor_parts(match.group(2))
        target = _dtype_name(element)
        found.append((_dtype_name(source_element), target, _tensor_bytes(dims, target)))
    return found


def _dtype_name(element: str) -> str:
    """The dtype name of an MLIR element type: `f8E4M3FN` -> `float8_e4m3fn`."""
    if element in _MLIR_TYPES:
        return _MLIR_TYPES[element]
    kind = re.fullmatch(r"(ui|i|f)(\d+)(\w*)", element)
    if kind is None:
        return element
    prefix, bits, variant = kind.groups()
    name = {"ui": "uint", "i": "int", "f": "float"}[prefix] + bits
    return name + (f"_{variant.lower()}" if variant else "")


def _tensor_bytes(dims: str, dtype: str) -> int:
    """The bytes of a tensor of MLIR dimensions `dims` (`4x8x`) and dtype `dtype`."""
    try:
        return math.prod(int(d) for d in dims.split("x") if d) * jnp.dtype(dtype).itemsize
    except (TypeError, ValueError):  # a dynamic dimension (`?`), a type numpy does not know
        return 0


__all__ = ["converts_in", "lowering_converts", "lowering_key"]
