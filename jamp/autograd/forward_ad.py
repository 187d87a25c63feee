"""torch.autograd.forward_ad's names: `dual_level`, `make_dual`, `unpack_dual`,
`UnpackedDualTensor`, `enter_dual_level`, `exit_dual_level` (implemented in
`jamp.transforms.forward_ad`)."""

from jamp.transforms.forward_ad import (UnpackedDualTensor, dual_level, enter_dual_level,
                                        exit_dual_level, make_dual, unpack_dual)

__all__ = ["UnpackedDualTensor", "dual_level", "enter_dual_level", "exit_dual_level",
           "make_dual", "unpack_dual"]
