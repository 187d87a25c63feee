"""Apex's `amp` front end for Flax and optax: `initialize`, `master_params`, `scale_loss`,
`state_dict` / `load_state_dict`, the master-weights optimizer wrapper behind O2, and checkpoints
of the whole training state that check what they are restored into."""

from jamp.frontend.amp_state import load_state_dict, scale_loss, state_dict
from jamp.frontend.checkpoint import (
    checkpoint_from_bytes,
    checkpoint_to_bytes,
    restore_checkpoint,
    save_checkpoint,
)
from jamp.frontend.initialization import initialize
from jamp.frontend.masters import MasterWeightsState, master_params, master_weights

__all__ = [
    "MasterWeightsState", "checkpoint_from_bytes", "checkpoint_to_bytes", "initialize",
    "load_state_dict", "master_params", "master_weights", "restore_checkpoint", "save_checkpoint",
    "scale_loss", "state_dict",
]
