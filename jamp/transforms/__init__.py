"""jaxpr-level transforms: autocast, custom_fwd/custom_bwd and the autograd tools.

The op tables autocast reads live in `jamp.policy` (`OpTable`, `autocast_table`, ...).
"""

from jamp.policy.primitives import primitive_names
from jamp.transforms.autocast import AutocastRegion, autocast
from jamp.transforms.custom_amp import custom_bwd, custom_fwd

__all__ = ["AutocastRegion", "autocast", "custom_bwd", "custom_fwd", "primitive_names"]
