"""torch's autocast state queries (`torch.is_autocast_enabled`, `torch.get_autocast_dtype`,
`torch.amp.is_autocast_available`) for the code an autocast transform traces.

A layer ported from torch asks them to decide what to cast. jamp has no autocast state at run
time: a transform traces its function and then decides each equation's dtype from the region
the equation was traced in (its name stack's region markers, the precision rules its module
path and Python stack match; `jamp.transforms.rules`). So the answer here is the region an
equation traced at the point of the question would get, from the same name stack and Python
stack and the same `rules.locate`. The one thing that is not on the name stack is which
transform is tracing (its dtype, op table and rules): `tracing` names it while its function
is traced.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator

import jax
import numpy as np

from jamp.policy.autocast_tables import autocast_table, canonical_device_type
from jamp.transforms import rules as precision_rules
from jamp.transforms.autocast_rules import Region

# The region of the transform whose function is being traced; None outside every transform.
_TRACING: contextvars.ContextVar[Region | None] = contextvars.ContextVar(
    "jamp_autocast_tracing", default=None)


@contextlib.contextmanager
def tracing(region: Region) -> Iterator[None]:
    """Names the transform (its own region, rules included) whose function is traced inside."""
    token = _TRACING.set(region)
    try:
        yield
    finally:
        _TRACING.reset(token)


def _region_in_force(device_type: str | None) -> Region | None:
    """The region in force at this point of a traced function where it is of `device_type`
    (its op table's); None outside every transform or in a region of another device type."""
    device = canonical_device_type(jax.default_backend() if device_type is None
                                   else device_type)
    start = _TRACING.get()
    if start is None:
        return None
    region = precision_rules.region_here(start)
    return region if canonical_device_type(region.table.device_type) == device else None


def is_autocast_enabled(device_type: str | None = None) -> bool:
    """Whether autocast for `device_type` is on where this is called (torch's name).

    Called while a `jamp.autocast` transform traces its function: True where that function's
    ops run under autocast of this device type, False inside `with jamp.autocast(enabled=
    False)`, a module a precision rule turns "off", or a region of another device type.
    Outside every transform False, as torch's default.

    Regions and modules are read off JAX's name stack, which JAX starts afresh for the body
    of a `jax.jit`, `lax.scan`, `lax.cond`, `jax.checkpoint`, `custom_jvp` or `custom_vjp`
    (and Flax's lifted transforms): there the answer sees the transform and what that body
    opens, not regions around the call. Derivative rules JAX traces after the function (a
    `custom_vjp`'s fwd and bwd) get the defaults.

    Args:
      device_type: "cuda" (or "gpu", "rocm"), "cpu" or "tpu"; None (torch's no-argument
        form, which asks about CUDA): `jax.default_backend()`, the device type
        `jamp.autocast` defaults to.

    Raises:
      TypeError / ValueError: for a device type that is not a string or not one of those.

    Example:
      >>> import jax.numpy as jnp, jamp
      >>> def layer(x):
      ...     if jamp.is_autocast_enabled("cpu"):
      ...         x = x.astype(jamp.get_autocast_dtype("cpu"))
      ...     return x * 2
      >>> jamp.autocast(layer, device_type="cpu", cast_outputs=False)(jnp.ones(2)).dtype
      dtype(bfloat16)
      >>> layer(jnp.ones(2)).dtype
      dtype('float32')
    """
    region = _region_in_force(device_type)
    return region is not None and region.enabled


def get_autocast_dtype(device_type: str) -> np.dtype:
    """The autocast dtype of `device_type` where this is called (torch's name).

    Called while a `jamp.autocast` transform of this device type traces its function: the
    dtype of the region in force (the transform's, a nested region's, or the dtype a precision
    rule gives the module it is called in), also where that region turns autocast off.
    Elsewhere the device type's default, as torch's: bfloat16 for "cpu" and "tpu", float16
    for "cuda". See `is_autocast_enabled` for where regions are seen.

    Raises:
      TypeError / ValueError: for a device type that is not a string or not one jamp has a
        table for ("cuda", "gpu", "rocm", "cpu", "tpu").
    """
    region = _region_in_force(device_type)
    return autocast_table(device_type).default_dtype if region is None else region.dtype


def is_autocast_available(device_type: str) -> bool:
    """Whether `jamp.autocast` takes `device_type` (torch.amp's name): True for "cuda",
    "gpu", "rocm", "cpu" and "tpu" in any case, False for any other string (torch's "mps",
    "xpu", ...).

    Raises:
      TypeError: for a device type that is not a string.
    """
    try:
        canonical_device_type(device_type)
    except ValueError:
        return False
    return True


__all__ = ["get_autocast_dtype", "is_autocast_available", "is_autocast_enabled", "tracing"]
