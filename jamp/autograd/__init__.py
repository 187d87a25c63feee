"""A namespace shaped like `torch.autograd`: the names torch users reach for, on JAX.

Everything is implemented in `jamp.transforms` (and `jamp.profile`); this package re-exports it
under torch's names and module layout (`jamp.autograd.functional`, `jamp.autograd.graph`, ...).
docs/autograd.md maps every name to torch's, with its status.
"""

from jamp.autograd import (
    anomaly_mode,
    forward_ad,
    function,
    functional,
    grad_mode,
    graph,
    profiler,
)
from jamp.autograd import gradcheck as _gradcheck_module
from jamp.autograd.anomaly_mode import detect_anomaly, set_detect_anomaly
from jamp.autograd.function import Function, FunctionCtx, once_differentiable
from jamp.autograd.grad_mode import (
    enable_grad,
    inference_mode,
    no_grad,
    register_hook,
    set_grad_enabled,
)
from jamp.autograd.gradcheck import GradcheckError, gradcheck, gradgradcheck

del _gradcheck_module

__all__ = [
    "Function", "FunctionCtx", "GradcheckError", "anomaly_mode", "detect_anomaly",
    "enable_grad", "forward_ad", "function", "functional", "grad_mode", "gradcheck",
    "gradgradcheck", "graph", "inference_mode", "no_grad", "once_differentiable", "profiler",
    "register_hook", "set_detect_anomaly", "set_grad_enabled",
]
