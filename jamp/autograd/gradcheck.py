"""torch.autograd.gradcheck's names: `gradcheck`, `gradgradcheck`, `GradcheckError`.

Implemented in `jamp.transforms.gradcheck`; this module only re-exports them.
"""

from jamp.transforms.gradcheck import GradcheckError, gradcheck, gradgradcheck

__all__ = ["GradcheckError", "gradcheck", "gradgradcheck"]
