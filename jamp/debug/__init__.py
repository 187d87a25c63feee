"""The precision debugger: where float16/bfloat16 breaks a program, and what to change.

- `precision_report(fn, *args, dtype=..., loss_scale=...)`: runs `fn` (and its backward pass)
  once in half precision beside a float32 shadow; ranks the overflows and underflows by
  equation, with source line and module; proposes `rules` for `jamp.autocast` and the loss
  scales that keep gradients representable.
- `first_nonfinite(fn, *args, ...)`: the first equation of the real low-precision run whose
  result is inf or NaN.

See docs/debugging.md.
"""

from jamp.debug.nonfinite import NonFinite, first_nonfinite
from jamp.debug.report import Finding, PrecisionReport, precision_report

__all__ = ["Finding", "NonFinite", "PrecisionReport", "first_nonfinite", "precision_report"]
