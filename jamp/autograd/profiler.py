"""torch.autograd.profiler's names: `profile`, `record_function`, `emit_nvtx`, `emit_itt` and the
event types.

Implemented in `jamp.profile`; this module only re-exports them, so that torch's imports
(`from jamp.autograd.profiler import record_function`) work as written.
"""

from jamp.profile import (
    EventList,
    FunctionEvent,
    FunctionEventAvg,
    emit_itt,
    emit_nvtx,
    profile,
    record_function,
)

__all__ = ["EventList", "FunctionEvent", "FunctionEventAvg", "emit_itt", "emit_nvtx", "profile",
           "record_function"]
