"""Apex's amp-level functions on an optimizer state: `scale_loss`, `state_dict`,
`load_state_dict`.

Apex keeps its loss scalers in a global; jamp keeps them in the optimizer state that
`jamp.initialize` (or `jamp.loss_scaled`) made, so these functions take that state.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jamp.frontend.masters import plain_state
from jamp.scaler import (
    CountingLossScale,
    LossScale,
    LossScaledState,
    find_loss_scaled_states,
    get_loss_scale,
)

_PREFIX = "loss_scaler"


def scale_loss(loss: Any, opt_state: Any, loss_id: int = 0) -> Any:
    """Apex's `amp.scale_loss`: `loss` times the current scale of loss `loss_id`.

    Differentiate the result and pass the grads to the optimizer's `update`, which unscales
    them (Apex does that when its context manager exits).

    Raises:
      ValueError: `opt_state` is a list of several optimizers' states. Apex shares one scaler
        per loss among optimizers; in jamp each optimizer keeps its own, and they drift apart
        after an overflow only one of them saw, so grads scaled with one and unscaled with the
        other would be silently wrong. Scale the loss once per optimizer (the grads of
        `scale_loss(loss, opt_state_k)` for optimizer k's params), or combine the optimizers
        into one with `optax.multi_transform`. Or `opt_state` holds no loss scale (a plain
        optax state: give the state of the optimizer `jamp.initialize` returned).

    Example:
      >>> import jax, jax.numpy as jnp, optax, jamp
      >>> tx = jamp.loss_scaled(optax.sgd(0.1))
      >>> opt_state = tx.init(jnp.ones(2))
      >>> jamp.scale_loss(jnp.float32(0.5), opt_state)
      Array(32768., dtype=float32)
    """
    opt_state = plain_state(opt_state)
    if type(opt_state) in (list, tuple) and len(find_loss_scaled_states(opt_state)) > 1:
        raise ValueError(
            f"scale_loss got {len(opt_state)} optimizer states: each jamp optimizer keeps its "
            f"own loss scale, so a loss whose grads reach several optimizers is scaled once per "
            f"optimizer (differentiate scale_loss(loss, opt_state_k) for optimizer k's params), "
            f"or the optimizers are combined into one with optax.multi_transform.")
    if type(opt_state) in (list, tuple) and len(opt_state) == 1:
        opt_state = opt_state[0]
    return get_loss_scale(_the_state(opt_state, "scale_loss"), loss_id=loss_id).scale(loss)


def _the_state(opt_state: Any, caller: str) -> LossScaledState:
    """The one `LossScaledState` in `opt_state`, for `caller` (named in the error)."""
    found = find_loss_scaled_states(plain_state(opt_state))
    if not found:
        raise ValueError(
            f"{caller} got an optimizer state holding no loss scale (a plain optax state?): "
            f"pass the state of an optimizer that scales losses, `tx.init(params)` of the tx "
            f"that jamp.initialize returned (with NNX: optimizer.opt_state after "
            f"jamp.initialize(model, optimizer)) or of jamp.loss_scaled(your_optax_tx).")
    if len(found) > 1:
        raise ValueError(
            f"{caller} got an optimizer state holding {len(found)} loss scales (several "
            f"jamp.loss_scaled optimizers side by side): pass the state of one of them.")
    return found[0]


def _scales(state: LossScaledState) -> tuple:
    return state.loss_scale if isinstance(state.loss_scale, tuple) else (state.loss_scale,)


def _counter(ls: LossScale) -> int:
    """Apex's `unskipped`: the finite steps since the scale last changed (a static scale
    never changes; jmp's `StaticLossScale` and `NoOpLossScale` keep no count)."""
    return int(np.asarray(ls.counter)) if isinstance(ls, CountingLossScale) else 0


def state_dict(opt_state: Any) -> dict[str, dict[str, Any]]:
    """Apex's amp state dict: `{"loss_scaler0": {"loss_scale": ..., "unskipped": ...}, ...}`,
    one entry per loss, as Python numbers."""
    return {f"{_PREFIX}{k}": {"loss_scale": float(np.asarray(ls.loss_scale)),
                              "unskipped": _counter(ls)}
            for k, ls in enumerate(_scales(_the_state(opt_state, "state_dict")))}


def _loaded(ls: LossScale, entry: dict) -> LossScale:
    """`ls` with the entry's scale and count, in the dtypes it holds them in: the fields of
    those names it has (`NoOpLossScale`'s scale is fixed at 1, a static scale keeps no count).
    """
    if not dataclasses.is_dataclass(ls):
        raise TypeError(f"cannot load a state into a loss scale of type {type(ls).__name__}: "
                        f"load_state_dict sets fields of dataclasses only.")
    values = {"loss_scale": entry["loss_scale"], "counter": entry["unskipped"]}
    changes = {f.name: jnp.asarray(values[f.name], jnp.asarray(getattr(ls, f.name)).dtype)
               for f in dataclasses.fields(ls) if f.name in values}
    return dataclasses.replace(ls, **changes) if changes else ls


def load_state_dict(opt_state: Any, state_dict: dict) -> Any:
    """`opt_state` with its loss scales loaded from Apex's amp state dict (Apex's rules).

    A count of entries different from the optimizer's number of losses warns, and entries past
    that number are skipped with a warning, as in Apex.

    An NNX optimizer's state (`optimizer.opt_state`, leaves wrapped in `nnx.OptState`
    Variables) is loaded in place, into its Variables, and returned.

    Raises:
      RuntimeError: a key that is not a `loss_scaler` entry (Apex's message).
    """
    plain = plain_state(opt_state)
    current = _the_state(plain, "load_state_dict")
    scales = list(_scales(current))
    if len(state_dict) != len(scales):
        warnings.warn(f"Warning: state_dict contains {len(state_dict)} entries, while "
                      f"{len(scales)} loss_scalers are used", stacklevel=2)
    unexpected = [key for key in state_dict if _PREFIX not in key]
    if unexpected:
        raise RuntimeError(
            "Error(s) in loading state_dict. Unexpected key(s) in state_dict: "
            + ", ".join(f'"{k}"' for k in unexpected) + ". ")
    for idx, key in enumerate(k for k in state_dict if _PREFIX in k):
        if idx > len(scales) - 1:
            warnings.warn(f"Skipping loss_scaler[{idx}], since num_losses was set to "
                          f"{len(scales)}", stacklevel=2)
            break
        scales[idx] = _loaded(scales[idx], state_dict[key])
    loaded = current._replace(
        loss_scale=tuple(scales) if isinstance(current.loss_scale, tuple) else scales[0])
    is_ours = lambda x: isinstance(x, LossScaledState)
    new = jax.tree_util.tree_map(lambda x: loaded if x is current else x, plain,
                                 is_leaf=is_ours)
    if plain is opt_state:
        return new
    # NNX Variables (flax.nnx is loaded, or there would be none): write the values into them,
    # so the optimizer holding them sees them.
    from flax import nnx
    is_var = lambda x: isinstance(x, nnx.Variable)
    jax.tree_util.tree_map(lambda var, value: var.set_value(value) if is_var(var) else None,
                           opt_state, new, is_leaf=is_var)
    return opt_state


__all__: Sequence[str] = ("scale_loss", "state_dict", "load_state_dict")
