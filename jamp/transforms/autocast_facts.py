"""What autocast's interpreter knows of the values of one jaxpr as it evaluates it.

Each fact is a pass of its own: it is told the jaxpr's inputs (`bind`) and each first-order
equation the interpreter has evaluated (`note`), and answers questions about values, which the
interpreter asks when it decides an equation's dtypes (`autocast_rules.Operand`):

- `Constants`: which values are constants of the program, and their largest magnitude (such a
  constant never rounds to infinity in the low dtype).
- `ScalarLikes`: which values are Python-scalar-like (literals and what is broadcast or computed
  from them: they follow the other operand); a loop's carries never are.
- `Weights`: which values are the jaxpr's inputs, moved or reshaped.
- `Kernels`: which values hold the low results of a linear layer's kernel, and which weight an
  op combines them with follows their dtype (a bias, a scale).

The passes read values through the `read` they are given (the interpreter's environment) and
keep nothing but their facts.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import numpy as np

from jamp import _jax_internals as jx
from jamp.policy import dtypes, primitives
from jamp.transforms import autocast_dataflow as dataflow
from jamp.transforms.autocast_rules import Region

Read = Callable[[Any], Any]


class Constants:
    """Values known to be constants of the program, each with its largest finite magnitude as
    a numpy scalar of its traced dtype.

    A rank-0 concrete value (a literal, a closed-over number) is one; so is an input the
    caller knows to be one (a body's constant operand), and what moves or selects among
    constants only. A constant the low dtype cannot hold is never narrowed to infinity (see
    `autocast_rules.overflows`).
    """

    def __init__(self, read: Read):
        self._read = read
        self._known: dict = {}

    def bind(self, var, value, known: np.generic | None = None) -> None:
        """Records an input of the jaxpr; `known`: a magnitude the caller knows it has."""
        if known is None:
            known = scalar_constant(value)
        if known is not None:
            self._known[var] = known

    def of(self, atom) -> np.generic | None:
        """The largest finite magnitude of `atom` when it is a constant, else None."""
        if isinstance(atom, jx.Literal):
            return scalar_constant(self._read(atom))
        return self._known.get(atom)

    def __contains__(self, atom) -> bool:
        return atom in self._known

    def note(self, eqn) -> None:
        """Records the constant an equation that only passes constants through returns."""
        if eqn.primitive.name not in primitives.CONSTANT_PRESERVING or len(eqn.outvars) != 1:
            return
        operands = [a for a in eqn.invars if dtypes.is_floating(a.aval)]
        magnitudes = [m for m in map(self.of, operands) if m is not None]
        out = eqn.outvars[0]
        if (not operands or len(magnitudes) != len(operands)
                or not dtypes.is_floating(out.aval)):
            return
        largest = max(magnitudes, key=float).astype(out.aval.dtype)
        if np.isfinite(largest):
            self._known[out] = largest




def scalar_constant(value) -> np.generic | None:
    """The magnitude of a concrete rank-0 floating value, when it is finite."""
    if jx.is_tracer(value) or np.ndim(value) != 0 or not dtypes.is_floating(value):
        return None
    magnitude = np.abs(np.asarray(value))[()]
    return magnitude if np.isfinite(magnitude) else None


class ScalarLikes:
    """Python-scalar-like values: they take the dtype of the other operands of an op and never
    widen them, as torch's Python scalars do.

    One is a rank-0 literal (a jaxpr's literals have lost their weak type), a weak-typed rank-0
    value, a weak-typed broadcast of one (`jnp.where`'s scalar), scalar math on such values
    (`jnp.var`'s n - ddof), or a constant of the program (`jnp.tril`'s zeros: a literal
    broadcast). A loop body's carries are the loop's values and never are: a time or a sum
    started from `0.0` does not follow what is added to it.
    """

    def __init__(self, read: Read, constants: Constants):
        self._read = read
        self._constants = constants
        self._known: set = set()
        self._carries: set = set()

    def bind(self, var, value, carry: bool = False) -> None:
        """Records an input of the jaxpr; `carry`: it is a loop body's carry."""
        if carry:
            self._carries.add(var)
        elif weak_scalar(var.aval) or weak_scalar(jax.typeof(value)):
            self._known.add(var)

    def follows(self, atom) -> bool:
        """True when `atom` is scalar-like."""
        if isinstance(atom, jx.Literal):
            return np.ndim(atom.val) == 0
        if atom in self._carries:
            return False
        return (atom in self._known or atom in self._constants or weak_scalar(atom.aval)
                or weak_scalar(jax.typeof(self._read(atom))))

    def note(self, eqn, values: Sequence[Any]) -> None:
        """Records which of an equation's outputs (`values`) are scalar-like."""
        name = eqn.primitive.name
        outs = eqn.outvars
        if name in primitives.MOVES:
            # jnp converts a weak scalar to a strong one of its dtype before using it, and
            # broadcasts it weak: both stay scalar-like (a strong array broadcast is not), as
            # does an integer scalar converted (a count).
            if self._all_follow(eqn) and all(
                    not o.aval.shape or getattr(jax.typeof(v), "weak_type", False)
                    for o, v in zip(outs, values, strict=True)):
                self._known.update(outs)
        elif (name in primitives.ELEMENTWISE and all(not o.aval.shape for o in outs)
              and self._all_follow(eqn)):
            # Scalar math on scalars (`jnp.log2`'s log(2), `jnp.var`'s n - ddof) is a Python
            # scalar computed in the program.
            self._known.update(outs)

    def _all_follow(self, eqn) -> bool:
        return all(self.follows(a) for a in eqn.invars if dtypes.is_floating(a.aval))


def weak_scalar(aval) -> bool:
    """True for a weak-typed rank-0 floating abstract value (a Python float traced)."""
    return (getattr(aval, "weak_type", False) and len(getattr(aval, "shape", ())) == 0
            and dtypes.is_floating(aval))


class Weights:
    """The jaxpr's inputs (parameters, among others) and values moved or assembled from them
    only, each with the (size, rank) of the input it comes from (`dataflow.shape_key`): a bias
    broadcast to a layer's output is smaller there."""

    def __init__(self):
        self._origins: dict = {}

    def bind(self, var) -> None:
        """Records an input of the jaxpr."""
        self._origins[var] = dataflow.shape_key(var)

    def __contains__(self, atom) -> bool:
        return not isinstance(atom, jx.Literal) and atom in self._origins

    def origin(self, atom) -> tuple[int, int]:
        """The (size, rank) of the input a weight comes from."""
        return self._origins[atom]

    def note(self, eqn) -> None:
        """Records an equation's outputs as weights when it moves or assembles weights only
        (flax's OptimizedLSTMCell concatenates its gates' kernels and biases)."""
        origin = dataflow.moved_weight(eqn, self._origins)
        if origin is not None:
            self._origins.update((o, origin) for o in eqn.outvars)


class Kernels:
    """The low values of a linear layer's kernel, and the weights that follow their dtype.

    torch's lower-precision kernels include pointwise work after their matmul: `linear`, conv
    and `addmm` add a bias; RNN/GRU/LSTM cells add two, then gate their state with the
    results. In a jaxpr that work is separate ops: a matmul or convolution of a weight
    (`is_linear_layer`) computes a kernel value, and so does pointwise math or a move of one;
    a weight such a value is combined with follows its dtype (`follower`).
    """

    def __init__(self, weights: Weights):
        self._weights = weights
        self._known: set = set()

    def note(self, eqn, region: Region, result: np.dtype) -> None:
        """Records an equation's outputs, computed in `result`, as kernel values when they
        are: a low linear layer, or its epilogue on a kernel value."""
        if result not in dtypes.HALF_DTYPES:
            return
        if self.is_linear_layer(eqn, region) or (
                eqn.primitive.name in _EPILOGUE and any(a in self._known for a in eqn.invars
                                                        if not isinstance(a, jx.Literal))):
            self._known.update(eqn.outvars)

    def mark(self, outvars) -> None:
        """Records values as a kernel's low results (a layer's output, rounded once)."""
        self._known.update(outvars)

    def is_linear_layer(self, eqn, region: Region) -> bool:
        """torch's linear and conv (see `autocast_dataflow.is_linear_layer`)."""
        return dataflow.is_linear_layer(eqn, region, self._weights)

    def follower(self, eqn) -> int | None:
        """The index of the operand that follows a kernel value's low dtype in this op, or
        None: a weight added to one when it is smaller than the result (a bias, broadcast),
        or multiplying or dividing it at any size (a scale, a cell state gated)."""
        name = eqn.primitive.name
        if name not in primitives.COMBINING:
            return None
        atoms = [a for a in eqn.invars if dtypes.is_floating(a.aval)]
        if len(atoms) != 2 or any(isinstance(a, jx.Literal) for a in atoms):
            return None
        result = eqn.outvars[0]
        for value, other in ((atoms[0], atoms[1]), (atoms[1], atoms[0])):
            if (value in self._known and other not in self._known and other in self._weights
                    and (name not in primitives.ADDITIVE
                         or dataflow.was_broadcast(self._weights.origin(other), result))):
                return eqn.invars.index(other)
        return None


# What torch computes inside a linear layer's kernel after its matmul: pointwise math and moves.
_EPILOGUE = primitives.ELEMENTWISE | primitives.MOVES


class Facts:
    """The passes of one evaluation of one jaxpr, told the same inputs and equations.

    Attributes:
      constants: see `Constants`.
      scalar_likes: see `ScalarLikes`.
      weights: see `Weights`.
      kernels: see `Kernels`.
    """

    def __init__(self, read: Read):
        self.constants = Constants(read)
        self.scalar_likes = ScalarLikes(read, self.constants)
        self.weights = Weights()
        self.kernels = Kernels(self.weights)

    def bind(self, var, value, constant: np.generic | None = None,
             carry: bool = False) -> None:
        """Records an input of the jaxpr (a const or an argument): `constant`, the magnitude of
        one known to be a constant of the program; `carry`, it is a loop body's carry."""
        self.constants.bind(var, value, constant)
        self.weights.bind(var)
        self.scalar_likes.bind(var, value, carry)

    def note(self, eqn, values: Sequence[Any]) -> None:
        """Records what a first-order equation's outputs (`values`) are, but for kernel
        values (`Kernels.note`, which needs the dtype the equation ran in)."""
        self.weights.note(eqn)
        self.scalar_likes.note(eqn, values)
        self.constants.note(eqn)


__all__ = ["Constants", "Facts", "Kernels", "ScalarLikes", "Weights", "scalar_constant",
           "weak_scalar"]
