"""torch's `GradScaler` in functional form.

`GradScaler` holds the settings (Python numbers, like torch's); the changing part, the scale
and the growth tracker, lives in a `GradScalerState` pytree that the caller threads through
its step. The update is torch's `_amp_update_scale_` rule, the unscale multiplies by the
float32 reciprocal of the scale, and `state_dict` / `load_state_dict` speak torch's five keys,
so a checkpoint moves between torch and jamp in both directions.

A state is a value, as optax's and flax's `DynamicScale` are: two arrays, and the settings it
was made with as hashable Python numbers in its pytree's static structure. States of equal
settings have equal tree structures (`jax.tree.map` takes two of them; a jitted step compiles
once for all of them); a state of other settings is another structure, for which a jitted step
traces again. A `set_*` call takes effect at the scaler's next `update`, as in torch: `update`
returns a state with the scaler's settings.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct

from jamp._checks import (
    StateDictKeyError,
    check_backoff_factor,
    check_bool,
    check_count,
    check_growth_factor,
    check_interval,
    check_positive,
    concrete_float,
    scalar_bool,
)
from jamp.scaler.loss_scale import all_finite, map_inexact
from jamp.scaler.protocol import loss_scale_dataclass

T = TypeVar("T")

_EMPTY_STATE_DICT = ("The source state dict is empty, possibly because it was saved from a "
                     "disabled instance of GradScaler.")
_SUBNORMAL_RECIPROCAL = np.float32(2.0**126)
_RESCALE = np.float32(2.0**-32)
_STATE_DICT_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval",
                    "_growth_tracker")


def _times(scale: jax.Array, factor: float) -> jax.Array:
    """`scale * factor` rounded to float32 the way torch's CPU kernel does it.

    torch multiplies the float32 scale by the factor in double and rounds the product to
    float32. With x64 enabled jamp does the same; otherwise the factor is rounded to float32
    first, which gives the same bits whenever the factor is a float32 number (2.0, 0.5, 0.25,
    0.75, 1.5, ...: every default and every power of two).
    """
    if jax.dtypes.canonicalize_dtype(jnp.float64) == jnp.float64:  # x64 is on
        return (scale.astype(jnp.float64) * np.float64(factor)).astype(jnp.float32)
    return scale * np.float32(factor)


@loss_scale_dataclass
class GradScalerState:
    """What a `GradScaler` step changes, with the settings it runs with; a pytree and a
    `LossScale` (`scale`, `unscale`, `adjust`: what `loss_scaled` calls).

    Leaves: `loss_scale` (float32 scalar, torch's `_scale`) and `counter` (int32 scalar,
    torch's `_growth_tracker`). The settings are hashable Python values in the pytree's static
    part, as in flax's `DynamicScale`: states of equal settings have one tree structure,
    whichever scaler made them. Make states with `GradScaler.init`, `update` or
    `load_state_dict`, which give them the scaler's settings in force.

    Attributes:
      loss_scale: the current scale.
      counter: consecutive finite steps since the last growth or back-off.
      growth_factor: multiplies the scale after `growth_interval` consecutive finite steps.
      backoff_factor: multiplies the scale after a step with inf or nan grads.
      growth_interval: consecutive finite steps between growths.
      enabled: False makes `scale`, `unscale` and `adjust` no-ops.
    """

    loss_scale: Any
    counter: Any
    growth_factor: float = struct.field(pytree_node=False, default=2.0)
    backoff_factor: float = struct.field(pytree_node=False, default=0.5)
    growth_interval: int = struct.field(pytree_node=False, default=2000)
    enabled: bool = struct.field(pytree_node=False, default=True)

    def __post_init__(self):
        if check_bool("enabled", self.enabled):
            check_growth_factor("growth_factor", self.growth_factor)
            check_backoff_factor("backoff_factor", self.backoff_factor)
            check_interval("growth_interval", self.growth_interval)

    def scale(self, outputs: T) -> T:
        """Multiplies the floating leaves of `outputs` by the scale (torch's dtype rule).

        As in torch, an output with dimensions keeps its dtype, while a 0-d output (a loss)
        is promoted with the float32 scale, so a float16 loss is scaled in float32.
        """
        if not self.enabled:
            return outputs

        def scale_leaf(x):
            x = jnp.asarray(x)
            if x.ndim == 0:
                return x * self.loss_scale
            return (x * self.loss_scale).astype(x.dtype)

        return map_inexact(scale_leaf, outputs)

    def unscale(self, grads: T) -> T:
        """Multiplies the floating and complex leaves of `grads` by the float32 reciprocal of
        the scale.

        Half-precision grads are multiplied in float32 and rounded back, as torch's kernel
        does; every grad keeps its dtype. Other leaves pass through.
        """
        if not self.enabled:
            return grads
        # torch takes the reciprocal in double and rounds it to float32; float32 division is
        # correctly rounded, and 1/s for a float32 s is never a double-rounding tie.
        scale = self.loss_scale.astype(jnp.float32)
        # Above 2**126 the reciprocal is subnormal, and XLA on CPU flushes it to zero, which
        # would zero every grad. There the reciprocal is taken of scale * 2**-32 and the 2**-32
        # applied after; below it `post` is 1 and the product is torch's, bit for bit.
        huge = scale > _SUBNORMAL_RECIPROCAL
        inv = 1.0 / jnp.where(huge, scale * _RESCALE, scale)
        post = jnp.where(huge, _RESCALE, jnp.float32(1.0))

        def unscale_leaf(g):
            g = jnp.asarray(g)
            if jnp.finfo(g.dtype).bits < 32:
                return (g.astype(jnp.float32) * inv * post).astype(g.dtype)
            real = jnp.finfo(g.dtype).dtype  # complex64's parts are float32
            return g * inv.astype(real) * post.astype(real)

        return map_inexact(unscale_leaf, grads)

    def adjust(self, grads_finite: Any) -> "GradScalerState":
        """torch's `_amp_update_scale_` rule, with `found_inf = not grads_finite`."""
        return self._adjusted(jnp.logical_not(scalar_bool("grads_finite", grads_finite)))

    def _adjusted(self, found_inf: jax.Array) -> "GradScalerState":
        if not self.enabled:
            return self
        scale = self.loss_scale
        successful = optax.safe_increment(self.counter)  # saturates, never wraps
        grow = successful == self.growth_interval
        grown = _times(scale, self.growth_factor)
        on_finite = jnp.where(grow & jnp.isfinite(grown), grown, scale)
        new_scale = jnp.where(found_inf, _times(scale, self.backoff_factor), on_finite)
        tracker = jnp.where(found_inf | grow, jnp.zeros_like(successful), successful)
        return dataclasses.replace(self, loss_scale=new_scale.astype(jnp.float32),
                                   counter=tracker.astype(jnp.int32))


class GradScaler:
    """torch's `GradScaler`, functional: the scale lives in a state you pass in and get back.

    Args:
      init_scale: the first scale (torch's 2**16).
      growth_factor: multiplies the scale after `growth_interval` consecutive finite steps;
        must be > 1.
      backoff_factor: multiplies the scale after a step with inf or nan grads; in (0, 1).
      growth_interval: consecutive finite steps between growths; an integer >= 1.
      enabled: False makes `scale`, `unscale` and `update` no-ops and `get_scale` 1.0.

    Raises:
      TypeError: a setting of the wrong type (`enabled="false"`, `growth_interval="2000"`).
      ValueError: a setting out of range (checked when enabled, as torch does).

    Example:
      >>> import jax, jax.numpy as jnp, optax, jamp
      >>> params = {"w": jnp.array([1.0, -2.0])}
      >>> loss = lambda p: jnp.sum(p["w"] ** 2)
      >>> tx = optax.sgd(0.1)
      >>> opt_state = tx.init(params)
      >>> scaler = jamp.GradScaler()
      >>> state = scaler.init()
      >>> grads = jax.grad(lambda p: scaler.scale(state, loss(p)))(params)
      >>> grads, found_inf = scaler.unscale(state, grads)
      >>> updates, opt_state = tx.update(grads, opt_state, params)
      >>> params = jamp.select_tree(found_inf, params, optax.apply_updates(params, updates))
      >>> state = scaler.update(state, found_inf)
      >>> params["w"], scaler.get_scale(state)
      (Array([ 0.8, -1.6], dtype=float32), 65536.0)
    """

    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000,
                 enabled: bool = True):
        self._enabled = check_bool("enabled", enabled)
        if self._enabled:
            check_positive("init_scale", init_scale)
            check_growth_factor("growth_factor", growth_factor)
            check_backoff_factor("backoff_factor", backoff_factor)
            growth_interval = check_interval("growth_interval", growth_interval)
        self._init_scale = init_scale
        self._growth_factor = growth_factor
        self._backoff_factor = backoff_factor
        self._growth_interval = growth_interval
        self._init_growth_tracker = 0

    def __repr__(self) -> str:
        return (f"GradScaler(init_scale={self._init_scale!r}, growth_factor="
                f"{self._growth_factor!r}, backoff_factor={self._backoff_factor!r}, "
                f"growth_interval={self._growth_interval!r}, enabled={self._enabled!r})")

    def _state(self, scale, tracker) -> GradScalerState:
        """A state of the settings in force, as hashable Python numbers."""
        if not self._enabled:
            scale, tracker = 1.0, 0
        return GradScalerState(
            jnp.asarray(scale, jnp.float32), jnp.asarray(tracker, jnp.int32),
            growth_factor=float(self._growth_factor), backoff_factor=float(self._backoff_factor),
            growth_interval=int(self._growth_interval), enabled=self._enabled)

    def init(self) -> GradScalerState:
        """A fresh state: the scale at `init_scale` (1.0 when disabled), the tracker at 0."""
        return self._state(self._init_scale, self._init_growth_tracker)

    def scale(self, state: GradScalerState, outputs: T) -> T:
        """Multiplies `outputs` (a loss, or any pytree) by the scale; identity when disabled."""
        if not self._enabled:
            return outputs
        return state.scale(outputs)

    def unscale(self, state: GradScalerState, grads: T) -> tuple[T, jax.Array]:
        """Unscales `grads` and reports whether any floating leaf holds inf or nan.

        Returns:
          `(grads, found_inf)`: the grads times the float32 reciprocal of the scale, each in
          its own dtype, and a scalar bool, True when the step must be skipped. Disabled:
          the grads untouched and False.
        """
        if not self._enabled:
            return grads, jnp.array(False)
        unscaled = state.unscale(grads)
        return unscaled, jnp.logical_not(all_finite(unscaled))

    def update(self, state: GradScalerState, found_inf: Any = None,
               new_scale: Any = None) -> GradScalerState:
        """The state after this step: torch's `_amp_update_scale_` rule.

        Args:
          state: the current state.
          found_inf: what `unscale` returned (a bool, or torch's float 0./1.; several
            optimizers' flags may be OR-ed together first).
          new_scale: set the scale to this value instead (the tracker is kept, as in torch).

        Raises:
          ValueError: neither `found_inf` nor `new_scale` given, or a bad `new_scale`.
        """
        if not self._enabled:
            return state
        if new_scale is not None:
            if np.size(new_scale) == 1 and np.ndim(new_scale) > 0:
                new_scale = jnp.reshape(new_scale, ())  # torch's one-element tensor
            check_positive("new_scale", new_scale)
            return self._state(jnp.asarray(new_scale, jnp.float32).reshape(()),
                               state.counter)
        if found_inf is None:
            raise ValueError("update needs found_inf (from unscale) or a new_scale.")
        found_inf = scalar_bool("found_inf", found_inf)
        return self._state(state.loss_scale, state.counter)._adjusted(found_inf)

    def get_scale(self, state: GradScalerState) -> float:
        """The current scale as a Python float (1.0 when disabled); traced, a float32 scalar."""
        if not self._enabled:
            return 1.0
        value = concrete_float(state.loss_scale)
        return state.loss_scale if value is None else value

    def get_growth_factor(self) -> float:
        """The scale growth factor."""
        return self._growth_factor

    def set_growth_factor(self, new_factor: float) -> None:
        """Sets the growth factor (> 1) of later `update` calls and the states they return."""
        check_growth_factor("growth_factor", new_factor)
        self._growth_factor = new_factor

    def get_backoff_factor(self) -> float:
        """The scale back-off factor."""
        return self._backoff_factor

    def set_backoff_factor(self, new_factor: float) -> None:
        """Sets the back-off factor, in (0, 1), of later `update` calls and their states."""
        check_backoff_factor("backoff_factor", new_factor)
        self._backoff_factor = new_factor

    def get_growth_interval(self) -> int:
        """The number of consecutive finite steps between growths."""
        return self._growth_interval

    def set_growth_interval(self, new_interval: int) -> None:
        """Sets the growth interval, an integer >= 1, of later `update` calls and their
        states."""
        self._growth_interval = check_interval("growth_interval", new_interval)

    def is_enabled(self) -> bool:
        """Whether this scaler scales at all."""
        return self._enabled

    def state_dict(self, state: GradScalerState) -> dict[str, Any]:
        """torch's five keys, as Python numbers; `{}` when disabled.

        `scale` and `growth_factor`/`backoff_factor` are floats, `growth_interval` and
        `_growth_tracker` ints: the dict loads into torch's `GradScaler.load_state_dict`.
        """
        if not self._enabled:
            return {}
        return {
            "scale": float(np.asarray(state.loss_scale)),
            "growth_factor": float(self._growth_factor),
            "backoff_factor": float(self._backoff_factor),
            "growth_interval": int(self._growth_interval),
            "_growth_tracker": int(np.asarray(state.counter)),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> GradScalerState:
        """Takes torch's five keys (from jamp or torch), sets the settings, returns the state.

        Disabled, this is a no-op returning `init()`, as in torch.

        Raises:
          RuntimeError: `state_dict` is empty (saved from a disabled scaler), torch's message.
          StateDictKeyError: one of the five keys is missing (a KeyError and a ValueError).
          TypeError: a value of the wrong type.
          ValueError: a value out of range.
        """
        if not self._enabled:
            return self.init()
        if len(state_dict) == 0:
            raise RuntimeError(_EMPTY_STATE_DICT)
        missing = [k for k in _STATE_DICT_KEYS if k not in state_dict]
        if missing:
            raise StateDictKeyError(f"GradScaler state dict lacks {missing}; expected "
                                    f"{list(_STATE_DICT_KEYS)}, got {sorted(state_dict)}.")
        check_positive("scale", state_dict["scale"])
        check_growth_factor("growth_factor", state_dict["growth_factor"])
        check_backoff_factor("backoff_factor", state_dict["backoff_factor"])
        interval = check_interval("growth_interval", state_dict["growth_interval"])
        # Any count torch can hold loads, even one past a since lowered growth_interval.
        tracker = check_count("_growth_tracker", state_dict["_growth_tracker"], minimum=0)
        self._init_scale = float(state_dict["scale"])
        self._growth_factor = float(state_dict["growth_factor"])
        self._backoff_factor = float(state_dict["backoff_factor"])
        self._growth_interval = interval
        self._init_growth_tracker = tracker
        return self.init()


__all__ = ["GradScaler", "GradScalerState"]
