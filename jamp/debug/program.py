"""The program the debugger looks at: `fn` under autocast and, for a scalar loss, its backward
pass at a loss scale, traced to one closed jaxpr; the checks of the debugger's arguments; and
where in the user's code each of its equations was written."""

from __future__ import annotations

import dataclasses
import functools
import linecache
import os
from typing import Any, Callable

import jax
import numpy as np

from jamp import _jax_internals as jx
from jamp._checks import check_positive, concrete_float
from jamp.policy.autocast_tables import (
    autocast_table, canonical_device_type, check_autocast_dtype)
from jamp.policy.dtypes import FLOAT32, is_floating, is_inexact
from jamp.transforms import autocast
from jamp.transforms import rules as precision_rules
from jamp.walker.walk import equations

TOP_LEVEL = "(top level)"


@dataclasses.dataclass(frozen=True)
class Program:
    """A traced program and how it was made.

    Attributes:
      closed: the closed jaxpr: `fn`'s outputs, then (with a backward pass) the gradients of
        `fn`'s scalar result times `loss_scale` with respect to the `argnums` arguments.
      args: the flat arguments it takes.
      dtype: the autocast dtype.
      backward: whether it has a backward pass.
      loss_scale: the scale its backward pass ran at.
      scalar: `fn` returns a floating scalar (a loss).
      note: why a scalar `fn` has no backward pass though one was asked for, or None.
    """

    closed: jx.ClosedJaxpr
    args: list
    dtype: np.dtype
    backward: bool
    loss_scale: float
    scalar: bool = False
    note: str | None = None


def checked_function(fn: Any, caller: str) -> Callable:
    if not callable(fn):
        raise TypeError(f"{caller}'s first argument must be the function to examine (a loss "
                        f"or an apply function); got {fn!r} of type {type(fn).__name__}.")
    transform = _autocast_transform(fn)
    if transform is not None:
        raise TypeError(
            f"{caller} takes the function as you would hand it to jamp.autocast; got {fn!r}, "
            f"already transformed by jamp.{transform}: pass the function it wraps, and its "
            "dtype and device_type as the debugger's own (the debugger applies autocast "
            "itself).")
    return fn


def _autocast_transform(fn: Any) -> str | None:
    """How `jamp.autocast` transformed `fn`, through partials and wrappers (`jax.jit`,
    `functools.wraps`), or None when it did not."""
    for _ in range(16):
        found = getattr(fn, "__jamp_autocast__", None)
        if isinstance(found, str):
            return found
        if isinstance(fn, functools.partial):
            fn = fn.func
        elif getattr(fn, "__wrapped__", None) is not None:
            fn = fn.__wrapped__
        else:
            return None
    return None


def checked_argnums(argnums: Any, args: tuple, caller: str) -> tuple[int, ...]:
    """`argnums` as a tuple of indices of `args`, checked: an int or a nonempty tuple of ints,
    each in range for the positional arguments given."""
    n = len(args)
    items = argnums if isinstance(argnums, (tuple, list)) else (argnums,)
    if not all(isinstance(i, (int, np.integer)) and not isinstance(i, (bool, np.bool_))
               for i in items):
        raise TypeError(f"{caller}'s argnums must be an int or a tuple of ints (the positions "
                        f"of the arguments to differentiate); got argnums={argnums!r}.")
    accepted = (f"from {-n} to {n - 1} for the {n} positional argument"
                f"{'' if n == 1 else 's'} given" if n else "none: no positional argument given")
    if not items:
        raise ValueError(f"{caller}'s argnums={argnums!r} names no argument: expected an int "
                         f"or a nonempty tuple of ints, positions {accepted}; to leave the "
                         "backward pass out, pass backward=False.")
    if not all(-n <= int(i) < n for i in items):
        raise ValueError(f"{caller}'s argnums={argnums!r} is out of range: expected positions "
                         f"{accepted}.")
    return tuple(int(i) % n for i in items)


def _check_differentiable(argnums: Any, positions: tuple[int, ...], args: tuple,
                          caller: str) -> None:
    """The arguments `argnums` selects hold floats only (their gradients are taken)."""
    for i in positions:
        for path, leaf in jax.tree_util.tree_leaves_with_path(args[i]):
            dtype = getattr(leaf, "dtype", None)
            if dtype is None:
                dtype = np.result_type(leaf) if isinstance(leaf, (int, float, complex)) \
                    else None
            if dtype is None or not is_inexact(dtype):
                where = f"argument {i}{jax.tree_util.keystr(path)}"
                raise TypeError(
                    f"{caller}'s argnums={argnums!r} takes the gradient with respect to "
                    f"{where}, of dtype {dtype}: gradients are taken with respect to floating "
                    "arguments only; choose argnums among those (integers and PRNG keys can "
                    "be passed at other positions).")


def settings(caller: str, dtype: Any, device_type: Any) -> tuple[np.dtype, str]:
    """The autocast (dtype, device type), checked: the dtype must be a half one."""
    device = canonical_device_type(jax.default_backend() if device_type is None
                                   else device_type)
    try:
        low = autocast_table(device).default_dtype if dtype is None \
            else check_autocast_dtype(dtype)
    except ValueError:
        raise ValueError(f"{caller} checks a half precision: dtype={dtype!r} is not a "
                         "half dtype; expected float16 or bfloat16.") from None
    if low == FLOAT32:
        raise ValueError(
            f"{caller} checks a half precision: dtype={dtype!r} is float32, which autocast "
            "leaves as it is; expected float16 or bfloat16.")
    return low, device


def checked_loss_scale(loss_scale: Any, caller: str) -> float | None:
    if loss_scale is None:
        return None
    if isinstance(loss_scale, (bool, np.bool_)) or concrete_float(loss_scale) is None:
        raise TypeError(f"{caller}'s loss_scale must be a positive finite number such as "
                        f"2.0**15 (or None for 1); got loss_scale={loss_scale!r}.")
    check_positive("loss_scale", loss_scale)
    return concrete_float(loss_scale)


def build(fn: Callable, args: tuple, kwargs: dict, *, caller: str, dtype: Any,
          device_type: Any, rules: Any, loss_scale: Any, argnums: Any,
          backward: bool = True) -> Program:
    """Traces `fn` under autocast, with its backward pass when it returns a floating scalar
    and `backward` is True; forward only, with a note, when that backward pass cannot exist
    (a `lax.while_loop` in the forward pass, which JAX does not differentiate in reverse mode).
    """
    checked_function(fn, caller)
    if not isinstance(backward, (bool, np.bool_)):
        raise TypeError(f"{caller}'s backward must be True (the backward pass too, for a "
                        f"scalar loss) or False (the forward pass only); got "
                        f"backward={backward!r}.")
    low, device = settings(caller, dtype, device_type)
    precision_rules.checked_rules(rules)
    scale = checked_loss_scale(loss_scale, caller)
    positions = checked_argnums(argnums, args, caller) if backward else ()
    bound = functools.partial(fn, **kwargs) if kwargs else fn
    low_fn = autocast(bound, dtype=low, device_type=device, rules=rules)
    out = jax.eval_shape(low_fn, *args)
    scalar = isinstance(out, jax.ShapeDtypeStruct) and out.shape == () and is_floating(out)
    leaves = jax.tree_util.tree_leaves(args)
    if not (backward and scalar):
        return Program(jax.make_jaxpr(low_fn)(*args), leaves, low, False, 1.0, scalar)
    _check_differentiable(argnums, positions, args, caller)
    used = 1.0 if scale is None else scale

    def program(*a):
        loss, grads = jax.value_and_grad(lambda *b: low_fn(*b) * used, argnums)(*a)
        return loss / used, grads

    try:
        return Program(jax.make_jaxpr(program)(*args), leaves, low, True, used, scalar)
    except ValueError as error:
        forward = jax.make_jaxpr(low_fn)(*args)
        if not any(e.primitive.name == "while" for e in equations(forward)):
            raise
        reason = str(error).splitlines()[0]
        note = (f"gradients are not analysed: the forward pass holds a lax.while_loop, which "
                f"JAX cannot differentiate in reverse mode ({reason}); only the forward pass "
                "ran (backward=False asks for that outright; a lax.scan or a fori_loop with "
                "static bounds is differentiable)")
        return Program(forward, leaves, low, False, 1.0, scalar, note)


_LIBRARIES = (os.sep + "site-packages" + os.sep, os.sep + "dist-packages" + os.sep, jx.JAMP_DIR)


def source(eqn) -> tuple[str, str]:
    """(`file:line`, the line's code) of the user's line that made `eqn`: the innermost frame
    outside installed libraries and jamp, else the innermost."""
    frames = jx.user_frames(eqn)
    if not frames:
        return "(unknown)", ""
    chosen = next((f for f in reversed(frames) if not any(lib in f[0] for lib in _LIBRARIES)),
                  frames[-1])
    file, line, _ = chosen
    return f"{file}:{line}", linecache.getline(file, line).strip()


__all__ = [
    "build", "checked_argnums", "checked_function", "checked_loss_scale", "Program", "settings",
    "source", "TOP_LEVEL"
]
