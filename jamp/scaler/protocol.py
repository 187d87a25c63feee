"""What every loss scale is: the `LossScale` protocol and the one pytree style they are made in.

The optax wrapper and Apex's `jamp.scale_loss` / `state_dict` / `load_state_dict` read a loss
scale only through `LossScale` (and `CountingLossScale` for the step count), and
`flax.serialization` stores the leaves of every class made with `loss_scale_dataclass`, so a
class of your own made so, with these members, works with them as jamp's own do:

    @jamp.scaler.loss_scale_dataclass
    class HalvingLossScale:
        loss_scale: jax.Array                                   # a leaf: the state
        floor: float = flax.struct.field(pytree_node=False, default=1.0)   # a setting

        def scale(self, tree): ...
        def unscale(self, tree): ...
        def adjust(self, grads_finite): ...
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
from typing import Any, Protocol, TypeVar, dataclass_transform, runtime_checkable

import jax
import numpy as np
from flax import struct

from jamp.scaler import serialization

T = TypeVar("T")

_REBUILDING = contextvars.ContextVar("rebuilding", default=False)
_HELD = "_static_settings"  # where an object keeps its settings' `_Setting`s


@runtime_checkable
class LossScale(Protocol):
    """jmp's loss-scale interface, as a protocol.

    jmp exports `LossScale` as the union of its three classes; here it is the interface they
    share, so `isinstance(x, LossScale)` holds for every jamp loss scale (jmp's three,
    `CountingStaticLossScale`, `GradScalerState`), for jmp's own objects and for a class of
    yours with the same four members. (`DynamicScale` keeps flax's API, whose `scale` is the
    current value, not a method: it is not one.)
    """

    @property
    def loss_scale(self) -> Any:
        """The current scale, a scalar."""

    def scale(self, tree: T) -> T:
        """`tree` (a loss) multiplied by the scale."""

    def unscale(self, tree: T) -> T:
        """`tree` (grads of a scaled loss) divided by the scale."""

    def adjust(self, grads_finite: Any) -> Any:
        """The loss scale for the next step, given whether this step's grads were finite."""


@runtime_checkable
class CountingLossScale(LossScale, Protocol):
    """A loss scale that counts finite steps (Apex's `unskipped`) in `counter`."""

    @property
    def counter(self) -> Any:
        """Finite steps counted (since the scale last changed, for a dynamic scale)."""


class _Setting:
    """A setting in a pytree's static part: compared by type, dtype and value, handed back as
    the very object that was given.

    JAX reuses a jit trace when the static parts compare equal. Plain `==` says that 128.0,
    `np.float32(128.0)` and `jnp.float32(128.0)` are equal, yet a bfloat16 loss times each is
    bfloat16 or float32, and on a reused trace the output would carry the first call's object.
    """

    __slots__ = ("value", "_key")

    def __init__(self, value: Any):
        self.value = value
        self._key: Any = None

    def key(self) -> tuple:
        if self._key is None:
            self._key = _setting_key(self.value)
        return self._key

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, _Setting) and self.key() == other.key()

    def __hash__(self) -> int:
        # Without the Python type: a numpy and a JAX scalar of one value may share a hash.
        return hash(self.key()[1:])

    def __repr__(self) -> str:
        return repr(self.value)


def _setting_key(x: Any) -> tuple:
    if isinstance(x, jax.core.Tracer):  # a setting traced inside jit has no value to read
        return (type(x), "id", id(x))
    if isinstance(x, (np.ndarray, np.generic, jax.Array)):
        arr = np.asarray(x)
        return (type(x), arr.dtype.str, arr.shape, arr.tobytes())
    return (type(x), x)


@dataclass_transform(frozen_default=True, field_specifiers=(dataclasses.field, struct.field))
def loss_scale_dataclass(cls: type[T] | None = None, /, **dataclass_options: Any) -> Any:
    """Makes `cls` a frozen dataclass and a pytree: the style of every jamp loss scale.

    Fields are the leaves (the state: the scale, a counter); fields declared with flax's
    `flax.struct.field(pytree_node=False, ...)` are settings, held in the static part of the
    pytree. A class with settings only is static data, equal to another of equal settings.
    Rebuilding the pytree calls the constructor, as `jax.tree_util.register_dataclass` does,
    but not `__post_init__`, where the checks belong: the leaves may then be anything
    (tracers, shape structs, shardings, path strings), and the settings were checked when the
    scale was made.
    `flax.serialization` stores the leaves by field name.

    Why not `flax.struct.dataclass` or `register_dataclass` themselves: they hand the settings
    to JAX as they are, and JAX compares them with `==` (see `_Setting`) and expects them
    hashable, which the array settings jmp takes (`min_loss_scale=np.ones([], np.float32)`) are
    not. Here the static part holds each setting in a `_Setting`; flax's field marker is kept,
    so the fields read as those of a flax struct.

    Args:
      cls: the class; `dataclass_options` (such as `eq=False`) go to `dataclasses.dataclass`.

    Returns:
      The class.
    """

    def make(cls: Any) -> Any:
        cls = dataclasses.dataclass(frozen=True, **dataclass_options)(cls)
        fields = dataclasses.fields(cls)
        leaves = tuple(f.name for f in fields if f.metadata.get("pytree_node", True))
        statics = tuple(f.name for f in fields if not f.metadata.get("pytree_node", True))

        def settings_of(obj: Any) -> tuple[_Setting, ...]:
            # Kept on the object, with the names they are of (a subclass may add settings):
            # a jitted step compares them at every call.
            held = vars(obj).get(_HELD)
            if held is None or held[0] is not statics:
                held = vars(obj)[_HELD] = (
                    statics, tuple(_Setting(getattr(obj, n)) for n in statics))
            return held[1]

        def flatten_with_keys(obj):
            keyed = [(jax.tree_util.GetAttrKey(n), getattr(obj, n)) for n in leaves]
            return keyed, settings_of(obj)

        def flatten(obj):
            return [getattr(obj, n) for n in leaves], settings_of(obj)

        def unflatten(settings, values):
            token = _REBUILDING.set(True)
            try:
                obj = cls(**dict(zip(leaves, values)),
                          **{n: s.value for n, s in zip(statics, settings)})
            finally:
                _REBUILDING.reset(token)
            vars(obj)[_HELD] = (statics, settings)
            return obj

        jax.tree_util.register_pytree_with_keys(cls, flatten_with_keys, unflatten, flatten)
        checks = getattr(cls, "__post_init__", None)
        if checks is not None and not getattr(checks, "skips_rebuilds", False):
            cls.__post_init__ = _unless_rebuilding(checks)
        if not leaves:
            # All static data (jmp's StaticLossScale): compared as JAX compares static parts.
            cls.__eq__ = lambda a, b: type(a) is type(b) and settings_of(a) == settings_of(b)
            cls.__hash__ = lambda a: hash((type(a), settings_of(a)))
        serialization.register(cls, leaves)
        return cls

    return make if cls is None else make(cls)


def _unless_rebuilding(checks: Any) -> Any:
    """`checks` (a `__post_init__`), skipped while JAX rebuilds the pytree from its leaves."""

    @functools.wraps(checks)
    def post_init(self):
        if not _REBUILDING.get():
            checks(self)

    post_init.skips_rebuilds = True  # type: ignore[attr-defined]
    return post_init


__all__ = ["CountingLossScale", "LossScale", "loss_scale_dataclass"]
