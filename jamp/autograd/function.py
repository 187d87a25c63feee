"""torch.autograd.function's names: `Function`, `FunctionCtx`, `once_differentiable`
(implemented in `jamp.transforms.function`)."""

from jamp.transforms.function import Function, FunctionCtx, once_differentiable

__all__ = ["Function", "FunctionCtx", "once_differentiable"]
