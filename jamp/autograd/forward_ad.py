"""torch's forward-mode AD API (`torch.autograd.forward_ad`) for JAX.

A dual level is what `jax.jvp` runs a function under: a JVP trace through which every
primitive is bound with its tangent rule. `jax.jvp` opens one around a function call; a
`dual_level` opens one for a `with` block (or around a decorated function), so torch's idiom
runs as written: inside it `make_dual(x, t)` gives a value whose computations carry the
tangent `t`, and `unpack_dual(y)` returns `y`'s primal and tangent. It works eagerly and inside
traced functions (`jax.jit`, `jax.grad`, `jax.vmap`), because the level is a trace like
`jax.jvp`'s own.

What cannot be ported: a dual value does not outlive its level. torch drops the tangent when
the level exits and the tensor lives on; here the dual value belongs to the closed trace, and
computing with it afterwards is a JAX error. Unpack inside the level and keep the primal
(`unpack_dual(y).primal`) or the tangent. The decorator form returns the primal parts of what
the function returns.
"""

from __future__ import annotations

import functools
import threading
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jamp import _jax_internals as jx
from jamp.policy.dtypes import is_inexact

__all__ = ["UnpackedDualTensor", "dual_level", "enter_dual_level", "exit_dual_level",
           "make_dual", "unpack_dual"]


class UnpackedDualTensor(NamedTuple):
    """What `unpack_dual` returns: the primal and the tangent (None where there is none)."""

    primal: Any
    tangent: Any


class _Levels(threading.local):
    # The open levels of this thread, innermost last (JAX's trace state is per thread too).
    def __init__(self):
        self.stack: list[jx.JVPLevel] = []


_LEVELS = _Levels()


def enter_dual_level() -> int:
    """Opens a new dual level and returns its index (torch's `enter_dual_level`). Prefer
    `with dual_level():`, which closes it however the block ends."""
    level = jx.JVPLevel()
    level.open()
    _LEVELS.stack.append(level)
    return len(_LEVELS.stack) - 1


def exit_dual_level(*, level: int | None = None) -> None:
    """Closes the innermost dual level (torch's `exit_dual_level`); `level`, when given, must
    be its index."""
    stack = _LEVELS.stack
    if not stack:
        raise RuntimeError("exit_dual_level: no dual level is open.")
    if level is not None and level != len(stack) - 1:
        raise RuntimeError(f"exit_dual_level: level {level} is not the innermost open level "
                           f"({len(stack) - 1}); levels close innermost first.")
    stack.pop().close()


class dual_level:
    """A forward-mode AD level: torch's `torch.autograd.forward_ad.dual_level`.

    As a context manager, `with dual_level():` opens a level for the block (its index is the
    `as` value). As a decorator, `dual_level()(fn)` runs `fn` inside a new level at each call
    and returns the primal parts of its results: the functional form, also inside `jax.jit`.

    Example:
      >>> import jax.numpy as jnp
      >>> from jamp.autograd import forward_ad as fwAD
      >>> with fwAD.dual_level():
      ...     x = fwAD.make_dual(jnp.array([0.0, 1.0]), jnp.array([1.0, 1.0]))
      ...     primal, tangent = fwAD.unpack_dual(jnp.sin(x) * 2.0)
      >>> tangent
      Array([2.       , 1.0806046], dtype=float32)
    """

    def __init__(self):
        self._levels: list[int] = []

    def __enter__(self) -> int:
        level = enter_dual_level()
        self._levels.append(level)
        return level

    def __exit__(self, *exc) -> None:
        exit_dual_level(level=self._levels.pop())

    def __call__(self, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def in_level(*args, **kwargs):
            with dual_level() as level:
                out = fn(*args, **kwargs)
                return jax.tree_util.tree_map(lambda y: unpack_dual(y, level=level).primal, out)

        return in_level


def _level(level: int | None, what: str) -> jx.JVPLevel:
    stack = _LEVELS.stack
    if not stack:
        raise RuntimeError(f"{what} needs an open dual level: call it inside "
                           f"`with dual_level():` or a function decorated with dual_level().")
    if level is None:
        return stack[-1]
    if not 0 <= level < len(stack):
        raise ValueError(f"{what}: level {level} is not open; open levels are "
                         f"0..{len(stack) - 1}.")
    return stack[level]


def make_dual(tensor: Any, tangent: Any, *, level: int | None = None) -> Any:
    """`tensor` carrying `tangent` at the dual level `level` (the innermost by default): every
    computation with the result inside the level propagates the tangent (torch's
    `make_dual`). `tensor` is a floating or complex array; `tangent` has its shape and dtype."""
    dual = _level(level, "make_dual")
    primal = jnp.asarray(tensor) if isinstance(tensor, (np.ndarray, np.generic)) else tensor
    tangent = jnp.asarray(tangent) if isinstance(tangent, (np.ndarray, np.generic)) else tangent
    if not isinstance(primal, jax.Array) or not is_inexact(primal):
        raise TypeError(f"make_dual: the primal must be a floating or complex array, got "
                        f"{tensor!r}.")
    if dual.owns(primal):
        raise ValueError("make_dual: the primal is already dual at this level; unpack it "
                         "first (unpack_dual(x).primal).")
    if not isinstance(tangent, jax.Array) or dual.owns(tangent):
        raise TypeError(f"make_dual: the tangent must be an array without a tangent of its own "
                        f"at this level, got {tangent!r}.")
    if tangent.shape != primal.shape or tangent.dtype != primal.dtype:
        raise ValueError(f"make_dual: the tangent must have the primal's shape and dtype "
                         f"({primal.dtype}{list(primal.shape)}), got "
                         f"{tangent.dtype}{list(tangent.shape)}.")
    return dual.dual(primal, tangent)


def unpack_dual(tensor: Any, *, level: int | None = None) -> UnpackedDualTensor:
    """`(primal, tangent)` of `tensor` at the dual level `level` (the innermost by default);
    the tangent is None where `tensor` carries none there (torch's `unpack_dual`). Outside any
    level every value is its own primal."""
    if not _LEVELS.stack:
        return UnpackedDualTensor(tensor, None)
    primal, tangent = _level(level, "unpack_dual").split(tensor)
    return UnpackedDualTensor(primal, tangent)
