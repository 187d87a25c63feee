"""Autocast (the jaxpr interpreter, its rules and dataflow, the function boundary and the
program cache, the state queries torch's layers ask), its precision rules by module path and
function (`rules`, with NNX calls named by graph path in `nnx_scopes`) and
`custom_fwd`/`custom_bwd`.

The op tables autocast reads live in `jamp.policy` (`OpTable`, `autocast_table`, ...); the
torch.autograd tools are in `jamp.autograd`.
"""

from jamp.policy.primitives import primitive_names
from jamp.transforms.autocast_api import AutocastRegion, autocast
from jamp.transforms.autocast_state import (
    get_autocast_dtype, is_autocast_available, is_autocast_enabled)
from jamp.transforms.custom_amp import custom_bwd, custom_fwd

__all__ = ["AutocastRegion", "autocast", "custom_bwd", "custom_fwd", "get_autocast_dtype",
           "is_autocast_available", "is_autocast_enabled", "primitive_names"]
