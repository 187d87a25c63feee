"""jaxpr-level transforms: autocast, custom_fwd/custom_bwd and the autograd tools."""

from jamp.policy.autocast_tables import (
    ACCUMULATE_FP32,
    DEFAULT_TABLES,
    FP32,
    LOWER,
    OpTable,
    autocast_table,
)
from jamp.policy.primitives import primitive_names
from jamp.transforms.autocast import AutocastRegion, autocast
from jamp.transforms.custom_amp import custom_bwd, custom_fwd

__all__ = [
    "ACCUMULATE_FP32", "AutocastRegion", "DEFAULT_TABLES", "FP32", "LOWER", "OpTable", "autocast",
    "autocast_table", "custom_bwd", "custom_fwd", "primitive_names",
]
