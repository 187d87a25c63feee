"""jamp: automatic mixed precision for JAX, Flax and optax.

The public face: names promised to users are re-exported here; nothing is defined here.
"""

from jamp import policy, transforms
from jamp.policy import (
    Policy,
    Properties,
    cast_to_full,
    cast_to_half,
    get_policy,
    half_dtype,
    properties,
)
from jamp import scaler
from jamp.scaler import (
    DynamicLossScale,
    DynamicScale,
    DynamicScaleResult,
    GradScaler,
    LossScale,
    NoOpLossScale,
    StaticLossScale,
    all_finite,
    get_loss_scale,
    loss_scaled,
    scaled_value_and_grad,
    select_tree,
)
from jamp.transforms import (
    autocast,
    custom_bwd,
    custom_fwd,
    get_autocast_dtype,
    is_autocast_available,
    is_autocast_enabled,
)
from jamp import autograd, debug, fp8, frontend, profile
from jamp.frontend import (
    MasterWeightsState,
    checkpoint_from_bytes,
    checkpoint_to_bytes,
    initialize,
    load_state_dict,
    master_params,
    master_weights,
    restore_checkpoint,
    save_checkpoint,
    scale_loss,
    state_dict,
)

__version__ = "0.1.0"

__all__ = [
    "all_finite", "autocast", "autograd", "cast_to_full", "cast_to_half", "checkpoint_from_bytes",
    "checkpoint_to_bytes", "custom_bwd", "custom_fwd", "debug", "DynamicLossScale", "DynamicScale",
    "DynamicScaleResult", "fp8", "frontend", "get_autocast_dtype", "get_loss_scale", "get_policy",
    "GradScaler", "half_dtype", "initialize", "is_autocast_available", "is_autocast_enabled",
    "load_state_dict", "LossScale", "loss_scaled", "master_params", "master_weights",
    "MasterWeightsState", "NoOpLossScale", "Policy", "policy", "profile", "Properties",
    "properties", "restore_checkpoint", "save_checkpoint", "scale_loss", "scaled_value_and_grad",
    "scaler", "select_tree", "state_dict", "StaticLossScale", "transforms"
]
