"""Profiling: torch.autograd.profiler's surface over JAX's real profiler, and the AMP report.

- `profile(...)`: records a block with `jax.profiler` and reads the trace back joined to the
  compiled programs: `key_averages()`, `table(...)`, `export_chrome_trace(path)`.
- `record_function`, `emit_nvtx`, `emit_itt`: labelled ranges, inside or outside `jax.jit`.
- `amp_report(fn, *args)`: how much of a program's matmul/conv FLOPs run in half precision and
  what its casts cost, read from the program itself (no device needed).

Also available as `jamp.autograd.profiler`. See docs/profile.md.
"""

from jamp.profile.report import AmpReport, amp_report
from jamp.profile.events import EventList, FunctionEvent, FunctionEventAvg
from jamp.profile.profiler import emit_itt, emit_nvtx, profile, record_function

__all__ = ["AmpReport", "EventList", "FunctionEvent", "FunctionEventAvg", "amp_report",
           "emit_itt", "emit_nvtx", "profile", "record_function"]
