"""A namespace shaped like `torch.autograd`: the names torch users reach for, on JAX.

Everything is implemented in `jamp.transforms` (and `jamp.profile`); this package re-exports it
under torch's names and module layout (`jamp.autograd.functional`, `jamp.autograd.graph`, ...).
docs/autograd.md maps every name to torch's, with its status.
"""

from jamp.autograd import function, functional, graph, gradcheck as _gradcheck_module
from jamp.autograd.function import Function, FunctionCtx, once_differentiable
from jamp.autograd.gradcheck import GradcheckError, gradcheck, gradgradcheck

del _gradcheck_module

__all__ = [
    "Function", "FunctionCtx", "GradcheckError", "function", "functional", "gradcheck",
    "gradgradcheck", "graph", "once_differentiable",
]
