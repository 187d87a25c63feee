"""Argument checks shared by every public entry point: one home for each rule and message.

Conventions: a value of the wrong type raises `TypeError`, a value of the right type out of
range raises `ValueError`, and both name the argument as the user wrote it (`loss_scale=-5.0`).

Numbers are checked only when concrete: inside `jax.jit` a traced scale cannot be inspected,
and JAX rebuilds pytrees from placeholder leaves, so a traced or placeholder value is let
through untouched.

This module imports nothing of jamp, so that every layer (policy, scaler, transforms) can use it.

The checks are written here rather than with chex's asserts: chex raises `AssertionError`
with its own wording, where these are user errors that keep torch's and jmp's exception types
and name the argument and the accepted values; jamp has no internal invariant that a chex
assert would state better.
"""

from __future__ import annotations

import numbers
from typing import Any

import jax
import numpy as np

# What a traced value raises when it is asked for its number.
_NOT_CONCRETE = (jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError)


class NotScalarBoolError(ValueError, AssertionError):
    """A flag that must be a scalar bool is not one.

    Both a `ValueError` (jamp's convention for a bad value) and an `AssertionError` (what jmp
    raises for the same mistake), so code written against either catches it.
    """


class StateDictKeyError(KeyError, ValueError):
    """A state dict lacks a key. Both a `KeyError` (torch) and a `ValueError` (flax)."""

    def __str__(self) -> str:  # KeyError would print the message's repr
        return str(self.args[0]) if self.args else ""


def _shown(name: str, value: Any) -> str:
    return f"{name}={value!r}"


def concrete_float(x: Any) -> float | None:
    """The value of a real scalar `x` as a Python float, or None when traced or not a number."""
    if isinstance(x, (bool, np.bool_)):
        return None
    try:
        arr = np.asarray(x)
    except _NOT_CONCRETE:
        return None
    if arr.shape != () or not (np.issubdtype(arr.dtype, np.floating)
                               or np.issubdtype(arr.dtype, np.integer)):
        return None
    return float(arr)


def _is_traced(x: Any) -> bool:
    return isinstance(x, jax.core.Tracer) or type(x) is object


def _number(name: str, value: Any, requirement: str) -> float | None:
    """`value` as a float; None when traced; TypeError when it is not a real number."""
    if _is_traced(value):
        return None
    v = concrete_float(value)
    if v is None:
        if isinstance(value, (np.ndarray, jax.Array)) and np.ndim(value) != 0:
            raise ValueError(f"{name} must be a scalar, got {name} of shape "
                             f"{np.shape(value)}.")
        raise TypeError(f"{name} must be {requirement}, got {_shown(name, value)}.")
    return v


def check_bool(name: str, value: Any) -> bool:
    """`value` as a bool; TypeError unless it is a Python or numpy bool.

    Strings such as "false" and numbers such as 0 are refused rather than read by truthiness.
    """
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be True or False, got {_shown(name, value)}.")
    return bool(value)


def check_positive(name: str, value: Any, *, allow_zero: bool = False) -> None:
    """Raises unless a concrete `value` is a finite number > 0 (>= 0 with `allow_zero`)."""
    bound = ">= 0" if allow_zero else "> 0"
    requirement = f"a finite number {bound}"
    v = _number(name, value, requirement)
    if v is not None and not (np.isfinite(v) and (v > 0 or (allow_zero and v == 0))):
        raise ValueError(f"{name} must be {requirement}, got {_shown(name, value)}.")


def check_growth_factor(name: str, value: Any) -> None:
    """Raises unless `value` is a finite number > 1."""
    v = _number(name, value, "a finite number > 1")
    if v is not None and not (np.isfinite(v) and v > 1.0):
        raise ValueError(f"{name} must be a finite number > 1, got {_shown(name, value)}.")


def check_backoff_factor(name: str, value: Any) -> None:
    """Raises unless `value` lies in the open interval (0, 1)."""
    v = _number(name, value, "a number in the open interval (0, 1)")
    if v is not None and not 0.0 < v < 1.0:
        raise ValueError(f"{name} must lie in the open interval (0, 1), got "
                         f"{_shown(name, value)}.")


def check_count(name: str, value: Any, minimum: int = 1) -> int:
    """`value` as an int; raises unless it is an integer >= `minimum`.

    Integral floats such as 2000.0 (what a JSON round trip may give) are accepted; 2000.5 is a
    ValueError, booleans and strings are TypeErrors.
    """
    requirement = f"an integer >= {minimum}"
    if isinstance(value, (bool, np.bool_, str)) or not (
            isinstance(value, numbers.Real) or isinstance(value, (np.ndarray, jax.Array))):
        raise TypeError(f"{name} must be {requirement}, got {_shown(name, value)}.")
    v = _number(name, value, requirement)
    if v is None or not (float(v).is_integer() and v >= minimum):
        raise ValueError(f"{name} must be {requirement}, got {_shown(name, value)}.")
    return int(v)


def check_interval(name: str, value: Any) -> int:
    """`value` as an int; raises unless it is an integer >= 1 (see `check_count`)."""
    return check_count(name, value, 1)


def parse_loss_scale(value: Any, name: str = "loss_scale") -> str | float:
    """Apex's loss-scale setting: "dynamic", or a positive finite number (a string holding one
    is read, as Apex's command-line flags give them); returns "dynamic" or the float."""
    if isinstance(value, str):
        if value == "dynamic":
            return value
        try:
            number = float(value)
        except ValueError:
            raise ValueError(
                f"{name} must be 'dynamic', a number or a string holding a number such as "
                f"'128.0', got {_shown(name, value)}.") from None
    else:
        maybe = _number(name, value, "'dynamic' or a positive finite number")
        if maybe is None:
            return value  # traced: taken as it is
        number = maybe
    if not (np.isfinite(number) and number > 0):
        raise ValueError(f"{name} must be a finite number > 0, got {_shown(name, value)}.")
    return number


def scalar_bool(name: str, value: Any) -> jax.Array:
    """`value` (a bool, or torch's float 0./1. flag) as a 0-d bool array.

    Raises:
      NotScalarBoolError: `value` has dimensions.
    """
    flag = jax.numpy.asarray(value)
    if flag.ndim != 0:
        raise NotScalarBoolError(f"expected boolean scalar {name}, got {name} of shape "
                                 f"{flag.shape} and dtype {flag.dtype}.")
    return flag.astype(bool)


class ArgumentAssertionError(ValueError, AssertionError):
    """An argument out of range, or arguments that do not go together, where torch raises an
    `AssertionError` (a `strategy` that is neither mode, gradcheck's flags in conflict).

    Both a `ValueError` (jamp's convention for a bad value) and an `AssertionError` (what
    torch raises for the same mistake), so code written against either catches it.
    """
