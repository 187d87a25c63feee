"""Validation of loss-scaling hyperparameters, shared by the jmp classes and GradScaler.

Values are checked only when they are concrete: inside `jax.jit` a traced scale cannot be
inspected, and JAX rebuilds pytrees from placeholder leaves, so a traced or placeholder value
is let through untouched.
"""

from __future__ import annotations

import numbers
from typing import Any

import jax
import numpy as np

# What a traced value raises when it is asked for its number.
_NOT_CONCRETE = (jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError)


def concrete_float(x: Any) -> float | None:
    """The value of a scalar `x` as a Python float, or None when it is traced or not a number."""
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


def check_positive(name: str, value: Any) -> None:
    """Raises ValueError unless a concrete `value` is a finite number > 0."""
    v = concrete_float(value)
    if v is None:
        if isinstance(value, (bool, np.bool_, str)) or value is None:
            raise ValueError(f"{name} must be a finite number > 0, got {value!r}.")
        return
    if not (np.isfinite(v) and v > 0):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}.")


def check_growth_factor(name: str, value: Any) -> None:
    """Raises ValueError unless `value` is a finite number > 1."""
    v = concrete_float(value)
    if v is None or not (np.isfinite(v) and v > 1.0):
        raise ValueError(f"{name} must be a finite number > 1, got {value!r}.")


def check_backoff_factor(name: str, value: Any) -> None:
    """Raises ValueError unless `value` lies in the open interval (0, 1)."""
    v = concrete_float(value)
    if v is None or not 0.0 < v < 1.0:
        raise ValueError(f"{name} must lie in the open interval (0, 1), got {value!r}.")


def check_interval(name: str, value: Any) -> int:
    """Returns `value` as an int, or raises ValueError unless it is an integer >= 1.

    Integral floats such as 2000.0 (what a JSON round trip may give) are accepted; 2000.5,
    booleans and strings are not.
    """
    if isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}.")
    if isinstance(value, numbers.Integral):
        ok = int(value) >= 1
    elif isinstance(value, numbers.Real) or isinstance(value, (np.ndarray, jax.Array)):
        v = concrete_float(value)
        ok = v is not None and float(v).is_integer() and v >= 1
    else:
        ok = False
    if not ok:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}.")
    return int(concrete_float(value))
