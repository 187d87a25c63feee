"""torch.autograd.graph's saved-tensor hooks: `saved_tensors_hooks`, `save_on_cpu`,
`disable_saved_tensors_hooks`, and jamp's `save_as(dtype)` (residuals stored in a narrower
dtype).

Implemented in `jamp.transforms.saved_tensors`; this module only re-exports them.
"""

from jamp.transforms.saved_tensors import (
    disable_saved_tensors_hooks,
    save_as,
    save_on_cpu,
    saved_tensors_hooks,
)

__all__ = ["disable_saved_tensors_hooks", "save_as", "save_on_cpu", "saved_tensors_hooks"]
