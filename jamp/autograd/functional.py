"""torch.autograd.functional's names: `jacobian`, `hessian`, `vjp`, `jvp`, `hvp`, `vhp`.

Implemented in `jamp.transforms.functional`; this module only re-exports them.
"""

from jamp.transforms.functional import hessian, hvp, jacobian, jvp, vhp, vjp

__all__ = ["hessian", "hvp", "jacobian", "jvp", "vhp", "vjp"]
