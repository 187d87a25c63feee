"""flax.serialization support for the loss scales, so checkpoints hold them without pickle.

Only the changing numbers are stored; the static settings come from the target that
`from_state_dict` / `from_bytes` restores into, as for any Flax state.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from flax import serialization

from jamp._checks import StateDictKeyError

from jamp.scaler.grad_scaler import GradScalerState
from jamp.scaler.loss_scale import (
    CountingStaticLossScale,
    DynamicLossScale,
    NoOpLossScale,
    StaticLossScale,
)


def _leaves_to_state_dict(*names):
    def to_state_dict(obj):
        return {name: serialization.to_state_dict(getattr(obj, name)) for name in names}

    def from_state_dict(target, state):
        missing = [name for name in names if name not in state]
        if missing:
            raise StateDictKeyError(f"Cannot restore {type(target).__name__}: the state dict "
                                    f"lacks {missing} (it has {sorted(state)}).")
        values = {name: jnp.asarray(state[name], jnp.asarray(getattr(target, name)).dtype)
                  for name in names}
        return dataclasses.replace(target, **values)

    return to_state_dict, from_state_dict


def _static(obj):
    return {}


def _restore_static(target, state):
    return target


serialization.register_serialization_state(
    DynamicLossScale, *_leaves_to_state_dict("loss_scale", "counter"), override=True)
serialization.register_serialization_state(
    GradScalerState, *_leaves_to_state_dict("loss_scale", "growth_tracker"), override=True)
serialization.register_serialization_state(
    CountingStaticLossScale, *_leaves_to_state_dict("counter"), override=True)
serialization.register_serialization_state(
    StaticLossScale, _static, _restore_static, override=True)
serialization.register_serialization_state(
    NoOpLossScale, _static, _restore_static, override=True)


__all__ = []
