"""`precision_report`: where a half-precision program overflows, underflows or rounds, and what
to change.

The program autocast makes of `fn` (with, for a scalar loss, its backward pass at a loss scale)
runs once under `jax.jit` with a float32 shadow (`shadow`). Each equation that returns float16
or bfloat16 values is measured against that dtype on its shadow values: the largest magnitude
(overflow when beyond the largest finite value), the share of nonzero values below the smallest
normal (subnormal: precision lost) and below half the smallest subnormal (flushed to zero), the
largest difference between the low run's value and the shadow's (the error rounding made so
far), and, for the backward pass, how many values would flush to zero at each loss scale
2**k for k in `SCALE_EXPONENTS`, from which the loss scales that keep gradients
representable are read. A shadow that is not finite itself (the program is broken in float32
too) is said first, with the equation where it went non-finite, and nothing is proposed from
it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Sequence

import jax.numpy as jnp
import numpy as np
from jax import lax

from jamp.debug import fp8_error
from jamp.debug import program as programs
from jamp.debug import shadow
from jamp.debug.nonfinite import NonFinite, locate
from jamp.debug.program import TOP_LEVEL, source
from jamp.fp8.recipes import Recipe, check_recipe
from jamp.transforms import rules as precision_rules
from jamp.transforms.rules import module_pattern

# A backward equation keeps gradients representable at a scale when at most this share of its
# nonzero values flush to zero there.
UNDERFLOW_TOLERANCE = 1e-3
# Underflows below this share are not listed as problems (softmax tails flush harmlessly).
UNDERFLOW_LISTED = 0.01
# The loss scales considered: 2**k for k in this range.
SCALE_EXPONENTS = range(-32, 65)
# The scales whose underflow is counted (the smallest scale that keeps gradients representable
# is looked for among them).
UNDERFLOW_EXPONENTS = range(0, 32)
# How often the proposed rules are checked by running the program again with them.
RULE_ROUNDS = 3
# The suggested loss scale stays this factor below the largest one at which no gradient
# overflows (room for larger gradients in later steps), and, unless a smaller gradient needs
# more, at most `LOSS_SCALE_CEILING` (Apex's ceiling for its dynamic scale): see
# `PrecisionReport.suggested_loss_scale`.
LOSS_SCALE_HEADROOM = 2.0 ** 8
LOSS_SCALE_CEILING = 2.0 ** 24


class _Measure(shadow.Probe):
    """The report's probe, per site: (largest |shadow|, nonzero, subnormal, flushed, largest
    |low - shadow| where the low value is finite, non-finite low values, and for backward
    sites a histogram of how many loss scales 2**k of `UNDERFLOW_EXPONENTS` each value
    flushes to zero at: `_flush_histogram`)."""

    def __init__(self, loss_scale: float | None):
        self.loss_scale = loss_scale

    def measure(self, sites, low, shadow_values):
        finfo = jnp.finfo(low.dtype)
        rows = low.shape[0]
        lo = low.reshape(rows, -1)
        sh = shadow_values.reshape(rows, -1).astype(jnp.float32)
        a = jnp.abs(sh)
        a = jnp.where(jnp.isnan(a), 0.0, a)
        finite = jnp.isfinite(lo)
        diff = jnp.where(finite, jnp.abs(lo.astype(jnp.float32) - sh), 0.0)
        nonzero = a > 0
        as_int = lambda mask: mask.astype(jnp.int32)
        flush = float(finfo.smallest_subnormal) / 2
        operands = [a, as_int(nonzero), as_int(nonzero & (a < np.float32(finfo.smallest_normal))),
                    as_int(nonzero & (a < np.float32(flush))), diff, as_int(~finite)]
        zero_f, zero_i = np.float32(0), np.int32(0)
        # One reduction computes them all: one loop over the values to compile, not one each.
        out = lax.reduce(tuple(operands), (zero_f, zero_i, zero_i, zero_i, zero_f, zero_i),
                         _reduce_step, (1,))
        if self.loss_scale is not None and sites[0].backward:
            counts = _flush_histogram(a, nonzero, flush * self.loss_scale)
        else:
            counts = jnp.zeros((rows, 0), jnp.int32)
        return (*out, counts)

    def combine(self, a, b):
        return (jnp.maximum(a[0], b[0]), a[1] + b[1], a[2] + b[2], a[3] + b[3],
                jnp.maximum(a[4], b[4]), a[5] + b[5], a[6] + b[6])

    def over_iterations(self, stacked):
        return (jnp.max(stacked[0], axis=0), jnp.sum(stacked[1], axis=0),
                jnp.sum(stacked[2], axis=0), jnp.sum(stacked[3], axis=0),
                jnp.max(stacked[4], axis=0), jnp.sum(stacked[5], axis=0),
                jnp.sum(stacked[6], axis=0))


def _reduce_step(x, y):
    return (jnp.maximum(x[0], y[0]), x[1] + y[1], x[2] + y[2], x[3] + y[3],
            jnp.maximum(x[4], y[4]), x[5] + y[5])


def _flush_histogram(magnitudes, nonzero, threshold: float):
    """Per row, a histogram of how many of the loss scales 2**0 ... 2**(n-1) each nonzero
    value flushes to zero at (n = len(UNDERFLOW_EXPONENTS); a value flushes at 2**k when it is
    below `threshold` / 2**k): column j counts the values that flush at exactly j of them, so
    the values flushing at scale 2**k are the sum of the columns after k (`_flush_counts`).

    A value below the threshold by a factor in [2**(j-1), 2**j) flushes at the scales 2**0
    ... 2**(j-1): one binary exponent per value gives its column, where a comparison per scale
    would make the program longer to compile by a reduction per scale.
    """
    rows = magnitudes.shape[0]
    n = len(UNDERFLOW_EXPONENTS)
    ratio = jnp.minimum(magnitudes / np.float32(threshold), 2.0)  # >= 1: flushes at no scale
    # float32's biased exponent: ratio in [2**(e - 127), 2**(e - 126)) flushes at 127 - e
    # scales (a subnormal ratio, e = 0, at all of them).
    biased = lax.shift_right_logical(lax.bitcast_convert_type(ratio, jnp.int32), 23)
    column = jnp.where(nonzero, jnp.clip(127 - biased, 0, n), 0)
    row = jnp.broadcast_to(jnp.arange(rows)[:, None], column.shape)
    return jnp.zeros((rows, n + 1), jnp.int32).at[row, column].add(1)


def _flush_counts(histogram) -> np.ndarray:
    """From `_flush_histogram`'s columns, how many values flush at each scale 2**k."""
    histogram = np.asarray(histogram)
    return np.cumsum(histogram[..., :0:-1], axis=-1)[..., ::-1]


@dataclasses.dataclass(frozen=True)
class Finding:
    """What one equation of the program did to its half-precision values.

    Attributes:
      kind: "overflow" (its values exceed the dtype's largest finite value), "underflow" (at
        least 1% of its nonzero values flush to zero) or "" (neither).
      primitive: the JAX primitive (`dot_general`, `mul`, `convert_element_type`...).
      location: the source `file:line` that made it (the innermost frame outside installed
        libraries, else the innermost).
      code: that line's text.
      module: its module path (`Net/Block_0/Dense_0`, or "(top level)").
      path: the module path as segments.
      backward: it belongs to the backward pass (its location is the forward line it
        differentiates).
      dtype: the half dtype of its results.
      max_abs: the largest magnitude of its values in the float32 shadow (over every iteration
        of the loops around it).
      largest: the largest finite value of `dtype`.
      underflow: the share of its nonzero values that flush to zero in `dtype`.
      subnormal: the share of its nonzero values below `dtype`'s smallest normal (underflow
        included).
      error: the largest difference between the low run's values and the shadow's, relative to
        `max_abs` (finite low values only).
      nonfinite: how many of the low run's values are inf or NaN.
    """

    kind: str
    primitive: str
    location: str
    code: str
    module: str
    path: tuple[str, ...]
    backward: bool
    dtype: str
    max_abs: float
    largest: float
    underflow: float
    subnormal: float
    error: float
    nonfinite: int

    @property
    def pass_name(self) -> str:
        return "backward" if self.backward else "forward"

    def to_dict(self) -> dict[str, Any]:
        """The finding as strict JSON-ready Python (see `PrecisionReport.to_dict`)."""
        out = dataclasses.asdict(self)
        out["path"] = list(self.path)
        out["pass"] = self.pass_name
        return _strict_json(out)


@dataclasses.dataclass(frozen=True)
class PrecisionReport:
    """What `precision_report` found. Printing it prints `table()`.

    A program whose float32 shadow is not finite (broken in float32 too, not only in the half
    dtype) gets `shadow_nonfinite`, said first when printed, and no rules, loss scales or
    gradient underflow read from it (empty or None, the reason in `notes`).

    Attributes:
      dtype: the half dtype checked.
      loss_scale: the scale the backward pass ran at (None without a backward pass).
      loss: the scalar result in the float32 shadow, or None when `fn` returns no scalar.
      low_loss: the same in the low-precision run.
      findings: every measured equation, in program order.
      problems: the overflows (in program order: the first is where the trouble starts), then
        the underflows (largest share first).
      rules: precision rules that move the modules that overflow to float32, the narrowest
        that remove every overflow of the forward pass: pass them to
        `jamp.autocast(..., rules=report.rules)` (before rules of your own).
      rules_checked: the program, run again with `rules`, no longer overflows in its forward
        pass (False when some overflow could not be placed in a module, or remained).
      unplaced: overflows outside every module (no module rule can move them).
      gradient_underflow: the share of the backward pass's nonzero half values that flush to
        zero at `loss_scale` (None without a backward pass).
      min_loss_scale: the smallest power of two at which every backward equation keeps all
        but `UNDERFLOW_TOLERANCE` of its nonzero values from flushing to zero, from 1 up to
        2**31 (None when none of those does).
      max_loss_scale: the largest power of two at which no backward value overflows.
      suggested_loss_scale: the initial loss scale to use (`DynamicLossScale(loss_scale=...)`,
        `GradScaler(init_scale=...)`): `max_loss_scale / LOSS_SCALE_HEADROOM` (2**8 below
        the edge), at most `LOSS_SCALE_CEILING` (2**24), raised to `min_loss_scale` when that
        is larger, and never above `max_loss_scale`. `min_loss_scale` alone sits at the edge
        of underflow: gradients just above it are subnormal in float16, with few bits left,
        and the real run's rounding loses some that the shadow keeps.
      shadow_nonfinite: where the float32 shadow first held an inf or a NaN (see
        `first_nonfinite`), or None when its outputs are finite.
      notes: what was not analysed, and why (no backward pass though `fn` returns a loss;
        nothing proposed from a shadow that is not finite).
      fp8: with `precision_report(..., fp8=recipe)`, each module's fp8 error (an
        `Fp8Error`: signal to noise of its products in fp8 against float32), worst first.
      fp8_rules: rules that keep the modules fp8 hurts most in bfloat16 and put the others
        in the recipe: `jamp.autocast(..., rules=report.fp8_rules)`.
    """

    dtype: str
    loss_scale: float | None
    loss: float | None
    low_loss: float | None
    findings: tuple[Finding, ...]
    problems: tuple[Finding, ...]
    rules: list
    rules_checked: bool
    unplaced: tuple[Finding, ...]
    gradient_underflow: float | None
    min_loss_scale: float | None
    max_loss_scale: float | None
    suggested_loss_scale: float | None
    shadow_nonfinite: NonFinite | None = None
    notes: tuple[str, ...] = ()
    fp8: tuple[fp8_error.Fp8Error, ...] = ()
    fp8_rules: list = dataclasses.field(default_factory=list)

    @property
    def overflows(self) -> tuple[Finding, ...]:
        return tuple(f for f in self.problems if f.kind == "overflow")

    def summary(self) -> str:
        """One line: which modules overflow in the forward pass (and the rules that move them),
        whether gradients overflow, and the suggested initial loss scale; or, first, that the
        float32 shadow is not finite."""
        if self.shadow_nonfinite is not None:
            found = self.shadow_nonfinite
            return (f"the float32 shadow is not finite ({found.value} first at "
                    f"{found.primitive} in {found.module}, {found.pass_name}): no rules and "
                    "no loss scale proposed from it")
        modules = sorted({f.module for f in self.overflows if not f.backward and f.path})
        if modules:
            parts = [f"{', '.join(modules)} overflow{'s' if len(modules) == 1 else ''} "
                     f"{self.dtype}; rules={_rules_text(self.rules)}"]
        else:
            parts = [f"no module overflows {self.dtype}" + (
                " at this scale" if self.loss_scale is not None else "")]
        if self.unplaced:
            parts.append(f"{len(self.unplaced)} equation(s) outside every module overflow "
                         f"{self.dtype}")
        backward = [f for f in self.overflows if f.backward]
        if backward:
            parts.append(f"{len(backward)} backward equation(s) overflow at loss scale "
                         f"{_number(self.loss_scale)}")
        if self.suggested_loss_scale is not None:
            parts.append(f"suggested initial loss scale {_power(self.suggested_loss_scale)}")
        return "; ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        """The report as plain Python that is strict JSON: `json.dumps(report.to_dict(),
        allow_nan=False)` takes it as it is. Non-finite numbers (`low_loss` once the half run
        overflowed, `loss` when float32 is broken too) become the strings "nan", "inf" and
        "-inf"; what is absent is None (null)."""
        return _strict_json(dict(
            dtype=self.dtype, loss_scale=self.loss_scale, loss=self.loss,
            low_loss=self.low_loss, findings=[f.to_dict() for f in self.findings],
            problems=[f.to_dict() for f in self.problems],
            fp8=[e.to_dict() for e in self.fp8],
            fp8_rules=[[p, repr(s) if isinstance(s, Recipe) else np.dtype(s).name]
                       for p, s in self.fp8_rules],
            rules=[[p, np.dtype(s).name] for p, s in self.rules],
            rules_checked=self.rules_checked, unplaced=[f.to_dict() for f in self.unplaced],
            gradient_underflow=self.gradient_underflow, min_loss_scale=self.min_loss_scale,
            max_loss_scale=self.max_loss_scale,
            suggested_loss_scale=self.suggested_loss_scale,
            shadow_nonfinite=None if self.shadow_nonfinite is None else
            self.shadow_nonfinite.to_dict(),
            notes=list(self.notes), summary=self.summary()))

    def table(self, row_limit: int | None = 20) -> str:
        """The report as text: a summary, the problems, then the largest rounding errors.

        Args:
          row_limit: the most rows per section; None or a negative number shows all.
        """
        if row_limit is not None and (isinstance(row_limit, bool)
                                      or not isinstance(row_limit, int)):
            raise TypeError(f"row_limit must be an int or None; got {row_limit!r}.")
        limit = None if row_limit is None or row_limit < 0 else row_limit
        scale = "forward only" if self.loss_scale is None else \
            f"forward and backward at loss scale {_number(self.loss_scale)}"
        lines = [] if self.shadow_nonfinite is None else \
            [f"the float32 shadow is not finite: {self.shadow_nonfinite}"]
        lines += [f"precision report: {self.dtype}, {scale}, {len(self.findings)} equations "
                  f"measured", self.summary(), *self.notes]
        if self.gradient_underflow is not None:
            lines.append(
                f"gradients: {self.gradient_underflow:.2%} of nonzero values flush to zero at "
                f"this scale; representable from {_power(self.min_loss_scale)}, overflow above "
                f"{_power(self.max_loss_scale)}")
        if self.rules and not self.rules_checked:
            lines.append("these rules did not remove every overflow when the program ran again "
                         "with them: a `with jamp.autocast(...)` region opened inside a moved "
                         "module keeps its own dtype (the rules apply where a module begins)")
        if self.unplaced:
            lines.append(f"{len(self.unplaced)} overflow(s) outside every module: wrap that "
                         "code in a module or `jax.named_scope`, or in `with "
                         "jamp.autocast(enabled=False)`")
        header = ("#", "problem", "pass", "module", "primitive", "max|x|", "flushed", "error",
                  "where", "code")
        rows = [_cells(i + 1, f.kind, f) for i, f in enumerate(self.problems[:limit])]
        lines += ["", *_columns([header, *rows], len(self.problems) - len(rows))]
        worst = sorted((f for f in self.findings if math.isfinite(f.error) and f.error > 0),
                       key=lambda f: -f.error)[:5 if limit is None else min(5, limit)]
        lines += ["", "largest rounding errors (relative to the value's magnitude):",
                  *_columns([header, *[_cells(i + 1, "rounding", f)
                                       for i, f in enumerate(worst)]], 0)]
        if self.fp8:
            lines += ["", *fp8_error.table_lines(self.fp8, self.fp8_rules, limit)]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def _cells(i: int, kind: str, f: Finding) -> tuple[str, ...]:
    return (str(i), kind, f.pass_name, f.module, f.primitive, f"{f.max_abs:.3g}",
            f"{f.underflow:.1%}", f"{f.error:.2g}", f.location, f.code[:60])


def _columns(rows: list[tuple[str, ...]], hidden: int) -> list[str]:
    widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    if len(rows) == 1 and not hidden:
        lines.append("(none)")
    return lines + ([f"... {hidden} more (row_limit)"] if hidden else [])


def _number(x: float | None) -> str:
    return _power(x) if x and math.log2(x).is_integer() else f"{x:g}"


def _power(x: float | None) -> str:
    if x is None:
        return "none"
    k = math.log2(x)
    return f"2^{int(k)}" if k.is_integer() else f"{x:g}"


def _rules_text(rules) -> str:
    return "[" + ", ".join(f"({p!r}, jnp.{np.dtype(s).name})" for p, s in rules) + "]"


def _strict_json(value: Any) -> Any:
    """`value` (dicts, lists, numbers, strings) with each non-finite float as "nan", "inf" or
    "-inf": strict JSON has no such numbers."""
    if isinstance(value, dict):
        return {k: _strict_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strict_json(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


# -- the report ---------------------------------------------------------------------------------

def precision_report(fn: Callable, *args: Any, dtype: Any = None, device_type: str | None = None,
                     rules: Any = None, loss_scale: float | None = None, argnums: Any = 0,
                     backward: bool = True, fp8: Any = None, **kwargs: Any) -> PrecisionReport:
    """Runs `fn` once in half precision beside a float32 shadow and reports where it breaks.

    `fn` runs under `jamp.autocast(fn, dtype=dtype, device_type=device_type, rules=rules)`;
    when it returns a floating scalar (a loss), its gradient with respect to the `argnums`
    arguments is taken too, of the loss times `loss_scale`, as a loss-scaled training step
    does (unless `backward` is False; where the backward pass cannot be built, a
    `lax.while_loop` in the forward pass, the forward pass alone runs, with a note in
    `notes`). The whole program, backward pass included, runs once under `jax.jit`, each
    equation (inside jit, scan, while, cond and remat bodies too, as maxima over iterations)
    evaluated on the program's own values and, alongside, on float32 ones (see `Finding` for
    what is measured).

    Args:
      fn: a loss (or any function of arrays); not already wrapped in `jamp.autocast`.
      *args: its positional arguments, arrays or pytrees of arrays.
      dtype: the half dtype: float16 or bfloat16; default: autocast's for `device_type`.
      device_type: autocast's device type ("cuda", "cpu", "tpu"); default: the backend's.
      rules: autocast precision rules to apply (e.g. a previous report's `rules`).
      loss_scale: the scale of the backward pass (default 1).
      argnums: which positional arguments the gradient is taken with respect to.
      backward: False: the forward pass only, also for a scalar loss (`argnums` unused).
      fp8: a `jamp.fp8.recipe(...)`: also measure each module's fp8 error in float32 (its
        own matmuls' products in fp8 against exact ones) and propose `fp8_rules` that keep
        the modules fp8 hurts most in bfloat16 (see `jamp.debug.fp8_error`).
      **kwargs: more arguments for `fn`, passed as they are (not traced).

    Returns:
      A `PrecisionReport`: print it for a table; `.rules` and `.suggested_loss_scale` are
      the fixes it proposes.

    Raises:
      TypeError: `fn` is not callable or is already transformed by `jamp.autocast`,
        `loss_scale` is not a number, `argnums` is not an int or a tuple of ints, or it
        selects an argument that is not floating (an integer, a PRNG key), `backward` is not
        a bool.
      ValueError: an unknown `dtype` or `device_type` (naming the accepted ones), a
        `loss_scale` that is not positive and finite, an `argnums` out of range or empty
        (`backward=False` leaves the backward pass out).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jamp.debug import precision_report
      >>> def loss(w, x):
      ...     with jax.named_scope("energy"):
      ...         h = (x * 1e3) @ w           # float16 under autocast: 1e5 overflows
      ...     return jnp.mean(h.astype(jnp.float32) ** 2) * 1e-9
      >>> w, x = jnp.ones((4, 4)), jnp.full((2, 4), 100.0)
      >>> report = precision_report(loss, w, x, dtype=jnp.float16, device_type="cuda")
      >>> first = report.overflows[0]
      >>> first.module, first.pass_name, first.code
      ('energy', 'forward', 'h = (x * 1e3) @ w           # float16 under autocast: 1e5 overflows')
      >>> report.rules
      [('/energy', <class 'jax.numpy.float32'>)]
    """
    caller = "precision_report"
    recipe = None if fp8 is None else check_recipe(fp8, "fp8")
    run = _runner(fn, args, kwargs, caller, dtype, device_type, loss_scale, argnums)
    first = run(rules, backward)
    if first.shadow_nonfinite is not None:
        return dataclasses.replace(first, rules_checked=False)
    proposed: list[tuple[str, Any]] = []
    checked = not _forward_overflows(first.findings)
    unplaced = tuple(f for f in _forward_overflows(first.findings) if not f.path)
    current = first
    for _ in range(RULE_ROUNDS if not checked else 0):
        added = _narrowest([f.path for f in _forward_overflows(current.findings) if f.path],
                           [p for p, _ in proposed])
        if not added:
            break
        proposed += [(module_pattern(p), jnp.float32) for p in added]
        # Only the forward pass can tell: its overflows are the ones the rules move.
        try:
            current = run(proposed + list(precision_rules.checked_rules(rules)),
                          backward=False)
        except precision_rules.OverriddenRuleError:
            break  # a region inside the module keeps its own dtype: no rule moves it
        if not _forward_overflows(current.findings):
            checked = True
            break
    errors, fp8_rules = fp8_error.measure(fn, args, kwargs, recipe) if recipe else ((), [])
    return dataclasses.replace(first, rules=proposed, rules_checked=checked and not unplaced,
                               unplaced=unplaced, fp8=errors, fp8_rules=fp8_rules)


def _forward_overflows(findings) -> list[Finding]:
    return [f for f in findings if f.kind == "overflow" and not f.backward]


def _narrowest(paths: Sequence[tuple[str, ...]], existing: Sequence[str]) -> list[tuple]:
    """The module paths to move: each overflowing module once, none inside another chosen."""
    unique = sorted(set(paths), key=len)
    chosen: list[tuple] = []
    for p in unique:
        if not any(p[:len(c)] == c for c in chosen) and module_pattern(p) not in existing:
            chosen.append(p)
    return chosen


def _runner(fn, args, kwargs, caller, dtype, device_type, loss_scale, argnums):
    """A function of the rules that builds the program, runs it with its shadow and reads the
    findings."""
    def run(rules, backward: bool = True) -> PrecisionReport:
        made = programs.build(fn, args, kwargs, caller=caller, dtype=dtype,
                              device_type=device_type, rules=rules, loss_scale=loss_scale,
                              argnums=argnums, backward=backward)
        evaluator = shadow.Evaluator(_Measure(made.loss_scale if made.backward else None))
        ran = evaluator.run_program(made.closed, made.args)
        # Only a broken program pays for a second run, to say where its shadow broke.
        broken = locate(made, of_shadow=True) if ran.shadow_code else None
        return _read(made, evaluator.sites, ran, broken)
    return run


def _read(made: programs.Program, sites: dict, ran: shadow.Run,
          broken: NonFinite | None) -> PrecisionReport:
    probes = ran.probes
    findings = [_finding(sites[key], probes[key]) for key in sorted(probes)]
    overflows = [f for f in findings if f.kind == "overflow"]
    underflows = sorted((f for f in findings if f.kind == "underflow"),
                        key=lambda f: -f.underflow)
    grads = [(sites[k], probes[k]) for k in sorted(probes) if sites[k].backward]
    notes = [made.note] if made.note else []
    scales = (None, None, None, None)
    if broken is not None:
        notes.append("no rules, loss scales or gradient underflow are read from a float32 "
                     "shadow that is not finite: the program is broken in float32 too; fix "
                     "it there first (see shadow_nonfinite)")
    elif made.backward:
        scales = _loss_scales(grads, made.loss_scale)
    return PrecisionReport(
        dtype=made.dtype.name, loss_scale=made.loss_scale if made.backward else None,
        loss=float(ran.shadow) if made.scalar else None,
        low_loss=float(ran.low) if made.scalar else None,
        findings=tuple(findings), problems=tuple(overflows + underflows), rules=[],
        rules_checked=True, unplaced=(), gradient_underflow=scales[0],
        min_loss_scale=scales[1], max_loss_scale=scales[2], suggested_loss_scale=scales[3],
        shadow_nonfinite=broken, notes=tuple(notes))


def _finding(site: shadow.Site, probe) -> Finding:
    max_abs, nonzero, subnormal, flushed, diff, nonfinite, _ = probe
    max_abs, nonzero = float(max_abs), int(nonzero)
    finfo = jnp.finfo(site.dtype)
    largest = float(finfo.max)
    underflow = int(flushed) / nonzero if nonzero else 0.0
    kind = "overflow" if max_abs > largest else (
        "underflow" if underflow >= UNDERFLOW_LISTED else "")
    location, code = source(site.eqn)
    return Finding(
        kind=kind, primitive=site.eqn.primitive.name, location=location, code=code,
        module="/".join(site.path) or TOP_LEVEL, path=site.path, backward=site.backward,
        dtype=site.dtype.name, max_abs=max_abs, largest=largest, underflow=underflow,
        subnormal=int(subnormal) / nonzero if nonzero else 0.0,
        error=float(diff) / max_abs if max_abs else 0.0, nonfinite=int(nonfinite))


def _loss_scales(grads, scale: float):
    """(share flushed at `scale`, min, max and suggested loss scales) from the backward
    equations' counts of values that flush at each scale (see `PrecisionReport`)."""
    flushed = sum(int(p[3]) for _, p in grads)
    nonzero = sum(int(p[1]) for _, p in grads)
    share = flushed / nonzero if nonzero else 0.0
    if not grads:
        return share, None, None, None
    # (largest magnitude at `scale`, largest finite value of its dtype) per backward equation.
    extremes = [(float(p[0]), float(jnp.finfo(s.dtype).max)) for s, p in grads]
    high = None
    for k in SCALE_EXPONENTS:
        if all(max_abs * 2.0 ** k / scale <= largest for max_abs, largest in extremes):
            high = 2.0 ** k
    counts = [(_flush_counts(p[6]), int(p[1])) for _, p in grads]
    low = next((2.0 ** k for i, k in enumerate(UNDERFLOW_EXPONENTS)
                if all(c[i] <= UNDERFLOW_TOLERANCE * nonzero for c, nonzero in counts)), None)
    return share, low, high, _suggested(low, high)


def _suggested(low: float | None, high: float | None) -> float | None:
    """The suggested loss scale from the smallest that keeps gradients from flushing and the
    largest that keeps them from overflowing (see `PrecisionReport.suggested_loss_scale`)."""
    if high is None:
        return low
    suggested = min(high / LOSS_SCALE_HEADROOM, LOSS_SCALE_CEILING)
    if low is not None:
        suggested = max(suggested, low)
    return min(suggested, high)


__all__ = [
    "Finding", "LOSS_SCALE_CEILING", "LOSS_SCALE_HEADROOM", "precision_report", "PrecisionReport",
    "RULE_ROUNDS", "SCALE_EXPONENTS", "UNDERFLOW_EXPONENTS", "UNDERFLOW_LISTED",
    "UNDERFLOW_TOLERANCE"
]
