"""Apex's `amp` front end for Flax and optax: `initialize`, `master_params`, `scale_loss`,
`state_dict` / `load_state_dict`, and the master-weights optimizer wrapper behind O2."""

from jamp.frontend.amp_state import load_state_dict, scale_loss, state_dict
from jamp.frontend.initialization import initialize
from jamp.frontend.master_weights import MasterWeightsState, master_params, master_weights

__all__ = [
    "MasterWeightsState", "initialize", "load_state_dict", "master_params", "master_weights",
    "scale_loss", "state_dict",
]
