"""`torch.autograd` for JAX: the names torch users reach for, in torch's module layout.

- `function`: `Function`, `FunctionCtx`, `once_differentiable` (on `jax.custom_vjp`).
- `functional`: `jacobian`, `hessian`, `vjp`, `jvp`, `hvp`, `vhp`.
- `gradcheck`, `gradgradcheck`, `GradcheckError`: derivatives checked against finite
  differences (in `finite_difference`; `jamp.autograd.gradcheck` is the function, as torch
  users call `torch.autograd.gradcheck(...)`).
- `graph`: saved-tensor hooks (`saved_tensors_hooks`, `save_on_cpu`,
  `disable_saved_tensors_hooks`, `save_as`).
- `anomaly_mode`: `detect_anomaly`, `set_detect_anomaly`.
- `forward_ad`: `dual_level`, `make_dual`, `unpack_dual`.
- `grad_mode`: `no_grad`, `enable_grad`, `set_grad_enabled`, `inference_mode`,
  `register_hook`.
- `profiler`: `jamp.profile` under torch's name.

docs/autograd.md maps every name to torch's, with its status.
"""

from jamp.autograd import (
    anomaly_mode,
    finite_difference,
    forward_ad,
    function,
    functional,
    grad_mode,
    graph,
    profiler,
)
from jamp.autograd.anomaly_mode import detect_anomaly, set_detect_anomaly
from jamp.autograd.function import Function, FunctionCtx, once_differentiable
from jamp.autograd.grad_mode import (
    enable_grad,
    inference_mode,
    no_grad,
    register_hook,
    set_grad_enabled,
)
from jamp.autograd.finite_difference import GradcheckError, gradcheck, gradgradcheck

__all__ = [
    "Function", "FunctionCtx", "GradcheckError", "anomaly_mode", "detect_anomaly",
    "enable_grad", "finite_difference", "forward_ad", "function", "functional", "grad_mode",
    "gradcheck", "gradgradcheck", "graph", "inference_mode", "no_grad", "once_differentiable",
    "profiler", "register_hook", "set_detect_anomaly", "set_grad_enabled",
]
