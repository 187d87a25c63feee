"""Which names are JAX primitives, what they do to values, and what torch's composite ops trace
to.

Op tables are keyed by primitive names (`jax.extend.core.Primitive.name`). torch's autocast lists
name ATen ops (`softmax`, `layer_norm`, `mse_loss`), most of which are not single primitives in
JAX: a table entry under such a name would match nothing. This module tells the two apart and, for
a name that is not a primitive, says what the torch op traces to here. It also sorts primitives
by what they do to values (move, compute elementwise, reduce, combine): the one table of
primitive names that autocast, its dataflow plans and the AMP report read (`ROLES`).

The call primitives, which follow JAX's versions, are `jamp._jax_internals`'; the walk over a
jaxpr's equations is `jamp.walker.walk`'s (see `jamp.policy` for why it may import those).
"""

from __future__ import annotations

import difflib
import functools
import sys
import warnings
from typing import Any, Callable, Iterable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jex_core

from jamp import _jax_internals as jx
from jamp.walker.walk import equations


# -- the table: what primitives do to values, by role --------------------------------------
# Every class of primitives that jamp's passes read is here (`ROLES` lists them; the call
# primitives, which follow JAX's versions, are `_jax_internals.CALLS`; the op tables' lists are
# policy, checked when a table is built). A name that is no primitive of the running JAX, nor
# one of `VERSION_SPECIFIC`, is an error the tests name.

# Ops that move, reshape or relabel values without computing new ones.
MOVES = frozenset({
    "broadcast_in_dim", "reshape", "squeeze", "transpose", "rev", "slice", "dynamic_slice",
    "convert_element_type", "copy", "pvary", "split",
})
# Elementwise math.
ELEMENTWISE = frozenset({
    "neg", "sign", "floor", "ceil", "round", "exp", "exp2", "log", "log1p", "expm1", "tanh",
    "logistic", "sin", "cos", "tan", "asin", "acos", "atan", "sinh", "cosh", "asinh", "acosh",
    "atanh", "lgamma", "digamma", "erf", "erfc", "erf_inv", "sqrt", "rsqrt", "cbrt", "abs",
    "square", "integer_pow", "real", "imag", "conj", "reduce_precision", "add", "add_any",
    "sub", "mul", "div", "rem", "pow", "max", "min", "atan2", "nextafter", "select_n", "clamp",
    "stop_gradient", "log2", "one_minus_square", "polynomial",
})
# Primitives that only some supported JAX versions have: jax 0.12 traces `jnp.log2` to `log2`
# (earlier versions divide a `log`), the derivative of tanh to `one_minus_square`, the
# polynomials of erf and of jax.random's samplers to `polynomial`; `jnp.stack` is its own
# primitive in some versions. Tables and classes may name them: where JAX lacks one, nothing
# traces to it.
VERSION_SPECIFIC = frozenset({"log2", "one_minus_square", "polynomial", "stack"})
# Ops that join whole arrays into one (`jnp.stack` is its own primitive in some JAX versions).
ASSEMBLES = frozenset({"concatenate", "stack"})
# Ops that write values into an array, their first operand (jnp's `.at[]`, torch's index_put).
SCATTERS = frozenset({
    "scatter", "scatter-add", "scatter-sub", "scatter-mul", "scatter-min", "scatter-max",
})
# Ops that pass one of their operands through as the result.
SELECTIONS = frozenset({"select_n", "clamp", "max", "min"})
# Reductions that shrink their operand, and those across devices (which keep its shape).
REDUCTIONS = frozenset({"reduce_sum", "reduce_max", "reduce_min", "reduce_prod"})
# Primitives that add up elements: with a rank-0 result, a sum to one number
# (`OpTable.scalar_results`).
SUMS = frozenset({"reduce_sum"})
# Products that add up products: with a rank-0 result, two vectors multiplied to one number.
DOT_PRODUCTS = frozenset({"dot_general"})
# Matrix products and convolutions: what torch's autocast lowers, whose FLOPs the AMP report
# counts (as torch's profiler `with_flops` does).
MATMULS = frozenset({"dot_general", "ragged_dot_general", "conv_general_dilated"})
COLLECTIVES = frozenset({"psum", "psum_invariant", "pmax", "pmin"})
CUMULATIVE = frozenset({"cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp"})
# What one torch kernel computes from its inputs, as a chain of primitives.
CHAIN = (ELEMENTWISE | MOVES | REDUCTIONS | COLLECTIVES | CUMULATIVE | ASSEMBLES
         | frozenset({"pad", "gather"}))
# Elementwise ops that combine two values: by adding (a bias, a residual) or by scaling (a
# scale, a gate). A layer's kernel and a normalization apply their parameters with these.
ADDITIVE = frozenset({"add", "sub", "add_any"})
SCALING = frozenset({"mul", "div"})
COMBINING = ADDITIVE | SCALING
# Additions, elementwise and into a destination.
ADDS = ADDITIVE | frozenset({"scatter-add", "scatter-sub"})
# Ops whose result is their first operand's values, moved (a convert changes them).
SAME_VALUES = (MOVES - {"convert_element_type"}) | frozenset({"stop_gradient"})
# Ops whose result holds only values of their floating operands (moved, selected, negated):
# a constant stays a constant, with the same largest magnitude.
CONSTANT_PRESERVING = MOVES | ASSEMBLES | SELECTIONS | frozenset({
    "gather", "neg", "abs", "stop_gradient", "pad",
})
# Primitives whose params hold jaxprs or computations typed for the traced dtypes (generic
# reduce/reduce_window bodies): autocast runs them in the traced dtypes.
TYPED_COMPUTATIONS = frozenset({
    "reduce", "reduce_window", "select_and_scatter", "select_and_scatter_add",
    "select_and_gather_add",
})

ROLES: dict[str, frozenset[str]] = {
    "MOVES": MOVES, "ELEMENTWISE": ELEMENTWISE, "ASSEMBLES": ASSEMBLES, "SCATTERS": SCATTERS,
    "SELECTIONS": SELECTIONS, "REDUCTIONS": REDUCTIONS, "SUMS": SUMS,
    "DOT_PRODUCTS": DOT_PRODUCTS, "MATMULS": MATMULS, "COLLECTIVES": COLLECTIVES,
    "CUMULATIVE": CUMULATIVE, "CHAIN": CHAIN, "ADDITIVE": ADDITIVE, "SCALING": SCALING,
    "COMBINING": COMBINING, "ADDS": ADDS, "SAME_VALUES": SAME_VALUES,
    "CONSTANT_PRESERVING": CONSTANT_PRESERVING, "TYPED_COMPUTATIONS": TYPED_COMPUTATIONS,
}


def primitive_names(fn: Callable, *args: Any, **kwargs: Any) -> list[str]:
    """The names of the primitives `fn(*args, **kwargs)` traces to, sub-programs included,
    in order of first appearance: the names an op table can use.

    Example:
      >>> import jax.numpy as jnp, jamp
      >>> def softmax(x):
      ...     e = jnp.exp(x - x.max())
      ...     return e / e.sum()
      >>> jamp.policy.primitive_names(softmax, jnp.ones(3))
      ['reduce_max', 'sub', 'exp', 'reduce_sum', 'div']
    """
    jaxpr = jax.make_jaxpr(fn)(*args, **kwargs).jaxpr
    return list(dict.fromkeys(eqn.primitive.name for eqn in equations(jaxpr)))


@functools.lru_cache(maxsize=1)
def _public_primitive_names() -> frozenset[str]:
    found: set[str] = set()
    for module in (jex_core.primitives, lax, lax.linalg):
        found.update(v.name for v in vars(module).values() if isinstance(v, jex_core.Primitive))
    return frozenset(found)


def _loaded_primitive_names() -> set[str]:
    # Primitives defined anywhere in the running program, user-defined ones included: looked at
    # only when a name is not among the public ones, since it walks every loaded module.
    found: set[str] = set()
    with warnings.catch_warnings():  # some modules warn when their globals are read
        warnings.simplefilter("ignore")
        for module in list(sys.modules.values()):
            try:
                values = list(vars(module).values())
            except TypeError:
                continue
            found.update(v.name for v in values if isinstance(v, jex_core.Primitive))
    return found


def unknown_names(names: Iterable[str]) -> list[str]:
    """The names among `names` that no loaded JAX primitive has (those of `VERSION_SPECIFIC`
    count as known in every version, so one table serves them all)."""
    missing = [n for n in names if n not in _public_primitive_names() | VERSION_SPECIFIC]
    if not missing:
        return []
    loaded = _loaded_primitive_names()
    return [n for n in missing if n not in loaded]


# numpy, so that importing jamp does not start a JAX backend.
_X = np.linspace(0.1, 1.0, 12, dtype=np.float32).reshape(3, 4)

# torch ops people put in autocast lists, with a JAX function that computes the same thing; the
# hint traces it, so it names what this JAX version really emits.
TORCH_COMPOSITES: dict[str, Callable[[], list[str]]] = {
    "softmax": lambda: primitive_names(jax.nn.softmax, _X),
    "log_softmax": lambda: primitive_names(jax.nn.log_softmax, _X),
    "logsumexp": lambda: primitive_names(jax.nn.logsumexp, _X),
    "layer_norm": lambda: primitive_names(
        lambda x: (x - x.mean(-1, keepdims=True))
        * lax.rsqrt(jnp.mean(jnp.square(x), -1, keepdims=True) - x.mean(-1, keepdims=True) ** 2
                    + 1e-5), _X),
    "gelu": lambda: primitive_names(jax.nn.gelu, _X),
    "silu": lambda: primitive_names(jax.nn.silu, _X),
    "sigmoid": lambda: primitive_names(jax.nn.sigmoid, _X),
    "relu": lambda: primitive_names(jax.nn.relu, _X),
    "sum": lambda: primitive_names(jnp.sum, _X),
    "mean": lambda: primitive_names(jnp.mean, _X),
    "var": lambda: primitive_names(jnp.var, _X),
    "mse_loss": lambda: primitive_names(lambda x: jnp.mean((x - 1.0) ** 2), _X),
    "cross_entropy": lambda: primitive_names(
        lambda x: -jnp.mean(jax.nn.log_softmax(x)[:, 0]), _X),
    "normalize": lambda: primitive_names(
        lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True), _X),
    "matmul": lambda: primitive_names(lambda x: x @ _X.T, _X),
    "linear": lambda: primitive_names(lambda x: x @ _X.T + 1.0, _X),
    "conv2d": lambda: primitive_names(
        lambda x: lax.conv_general_dilated(x[None, None], x[None, None, :2, :2], (1, 1),
                                           "SAME"), _X),
}
for _alias, _name in (("layernorm", "layer_norm"), ("group_norm", "layer_norm"),
                      ("batch_norm", "layer_norm"), ("mm", "matmul"), ("bmm", "matmul"),
                      ("addmm", "linear"), ("einsum", "matmul"), ("dot", "matmul"),
                      ("conv", "conv2d"), ("conv1d", "conv2d"), ("conv3d", "conv2d")):
    TORCH_COMPOSITES[_alias] = TORCH_COMPOSITES[_name]


def unknown_name_hint(name: str) -> str:
    """What to write instead of `name`, which is not a primitive."""
    composite = TORCH_COMPOSITES.get(name.lower()) if isinstance(name, str) else None
    if composite is not None:
        # Moves and calls are left out: a table rule for them decides nothing.
        emitted = [p for p in composite()
                   if p not in MOVES | jx.CALLS and p != "stop_gradient"]
        return f"torch's {name!r} is not one primitive here: it traces to {', '.join(emitted)}."
    close = difflib.get_close_matches(str(name), sorted(_public_primitive_names()), n=3)
    if close:
        return f"For {name!r}, did you mean {' or '.join(map(repr, close))}?"
    return ""


LIST_PRIMITIVES_HINT = ("List the primitives a function traces to with "
                        "jamp.transforms.primitive_names(fn, *args), or pass a "
                        "jax.extend.core.Primitive object for a primitive of your own.")


__all__ = [
    "ASSEMBLES", "CHAIN", "COLLECTIVES", "CUMULATIVE", "DOT_PRODUCTS", "ELEMENTWISE",
    "LIST_PRIMITIVES_HINT", "MOVES", "primitive_names", "REDUCTIONS", "SCATTERS", "SELECTIONS",
    "SUMS", "TORCH_COMPOSITES", "unknown_name_hint", "unknown_names", "VERSION_SPECIFIC"
]
