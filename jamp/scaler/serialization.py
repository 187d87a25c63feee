"""flax.serialization support for the loss scales, so checkpoints hold them without pickle.

Only the changing numbers, a loss scale's pytree leaves, are stored, by field name; the static
settings come from the target that `from_state_dict` / `from_bytes` restores into, as for any
Flax state. `loss_scale_dataclass` registers every class made with it here.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax.numpy as jnp
from flax import serialization

from jamp._checks import StateDictKeyError


def register(cls: type, leaves: Sequence[str]) -> None:
    """Stores `cls`'s fields named `leaves` in its state dict, and restores them in the
    dtypes the target's have."""

    def to_state_dict(obj: Any) -> dict[str, Any]:
        return {name: serialization.to_state_dict(getattr(obj, name)) for name in leaves}

    def from_state_dict(target: Any, state: dict[str, Any]) -> Any:
        missing = [name for name in leaves if name not in state]
        if missing:
            raise StateDictKeyError(f"Cannot restore {type(target).__name__}: the state dict "
                                    f"lacks {missing} (it has {sorted(state)}).")
        # result_type reads the dtype of an array, a Python number and a ShapeDtypeStruct (an
        # abstract target: jax.eval_shape's) alike.
        values = {name: jnp.asarray(state[name], jnp.result_type(getattr(target, name)))
                  for name in leaves}
        return dataclasses.replace(target, **values)

    serialization.register_serialization_state(cls, to_state_dict, from_state_dict,
                                               override=True)


__all__ = ["register"]
