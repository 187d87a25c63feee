"""Loss scaling: jmp's loss scales, torch's GradScaler and an optax wrapper that skips bad steps.

`import jamp.scaler as jmp` runs code written against jmp's loss-scaling API, and
`jamp.DynamicScale` is flax's `DynamicScale`. Every loss scale is a `LossScale` (jmp's name,
here a protocol) made with `loss_scale_dataclass`; see `jamp.scaler.protocol`.
"""

from jamp._checks import NotScalarBoolError, StateDictKeyError
from jamp.scaler.dynamic_scale import DynamicScale, DynamicScaleResult
from jamp.scaler.grad_scaler import GradScaler, GradScalerState
from jamp.scaler.loss_scale import (
    CountingStaticLossScale,
    DynamicLossScale,
    NoOpLossScale,
    StaticLossScale,
    all_finite,
    select_tree,
)
from jamp.scaler.optax_wrapper import (
    LossScaledState,
    LossScaledTransformation,
    find_loss_scaled_states,
    get_loss_scale,
    loss_scaled,
)
from jamp.scaler.protocol import CountingLossScale, LossScale, loss_scale_dataclass
from jamp.scaler.value_and_grad import ScaledValueAndGrad, scaled_value_and_grad

__all__ = [
    "CountingLossScale", "CountingStaticLossScale", "DynamicLossScale", "DynamicScale",
    "DynamicScaleResult", "GradScaler", "GradScalerState", "LossScale", "LossScaledState",
    "LossScaledTransformation",
    "NoOpLossScale", "NotScalarBoolError", "ScaledValueAndGrad", "StateDictKeyError",
    "StaticLossScale", "all_finite", "find_loss_scaled_states", "get_loss_scale",
    "loss_scale_dataclass", "loss_scaled", "scaled_value_and_grad", "select_tree",
]
