"""The program the debugger looks at: `fn` under autocast and, for a scalar loss, its backward
pass at a loss scale, traced to one closed jaxpr; and the checks of the debugger's arguments."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from jamp import _jax_internals as jx
from jamp._checks import check_positive, concrete_float
from jamp.policy.autocast_tables import (
    autocast_table, canonical_device_type, check_autocast_dtype)
from jamp.transforms import autocast
from jamp.transforms import rules as precision_rules


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
    """

    closed: jx.ClosedJaxpr
    args: list
    dtype: np.dtype
    backward: bool
    loss_scale: float


def checked_function(fn: Any, caller: str) -> Callable:
    if not callable(fn):
        raise TypeError(f"{caller}'s first argument must be the function to examine (a loss "
                        f"or an apply function); got {fn!r} of type {type(fn).__name__}.")
    return fn


def settings(caller: str, dtype: Any, device_type: Any) -> tuple[np.dtype, str]:
    """The autocast (dtype, device type), checked: the dtype must be a half one."""
    device = canonical_device_type(jax.default_backend() if device_type is None
                                   else device_type)
    low = autocast_table(device).default_dtype if dtype is None else check_autocast_dtype(dtype)
    if low == np.dtype(np.float32):
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
    (and `backward`)."""
    checked_function(fn, caller)
    low, device = settings(caller, dtype, device_type)
    precision_rules.checked_rules(rules)
    scale = checked_loss_scale(loss_scale, caller)
    bound = functools.partial(fn, **kwargs) if kwargs else fn
    low_fn = autocast(bound, dtype=low, device_type=device, rules=rules)
    out = jax.eval_shape(low_fn, *args)
    backward = (backward and isinstance(out, jax.ShapeDtypeStruct) and out.shape == ()
                and jnp.issubdtype(out.dtype, jnp.floating))
    if backward:
        used = 1.0 if scale is None else scale

        def program(*a):
            loss, grads = jax.value_and_grad(lambda *b: low_fn(*b) * used, argnums)(*a)
            return loss / used, grads

        traced = jax.make_jaxpr(program)(*args)
    else:
        used = 1.0
        traced = jax.make_jaxpr(low_fn)(*args)
    return Program(traced, jax.tree_util.tree_leaves(args), low, backward, used)
