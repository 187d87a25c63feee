"""torch.autograd.grad_mode's names: `no_grad`, `enable_grad`, `set_grad_enabled`,
`inference_mode`, with `register_hook` (torch's `Tensor.register_hook` as a function)
(implemented in `jamp.transforms.grad_mode`)."""

from jamp.transforms.grad_mode import (enable_grad, inference_mode, no_grad, register_hook,
                                       set_grad_enabled)

__all__ = ["enable_grad", "inference_mode", "no_grad", "register_hook", "set_grad_enabled"]
