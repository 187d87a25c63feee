"""Autocast's dtype decisions: regions, and the dtype each input of an equation is cast to.

Nothing here binds a primitive; the interpreter asks and applies the answers.

Regions are `jax.named_scope`s whose names carry a marker, `jamp_autocast[key=value,...]`.
JAX keeps scope names on every equation's name stack, also through differentiation
(`jvp(scope)`, `transpose(jvp(scope))`), so a region survives `jax.grad` inside the transformed
function without any global state.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Iterable, Sequence, cast

import jax.numpy as jnp
import numpy as np

from jamp.policy import primitives
from jamp.policy.autocast_tables import (
    ACCUMULATE_FP32, FP32, FP32_STATISTICS, LOWER, OpTable, autocast_table)
from jamp.policy.dtypes import AUTOCAST_DTYPES, FLOAT32

MARKER_PREFIX = "jamp_autocast"
_MARKER_RE = re.compile(re.escape(MARKER_PREFIX) + r"\[([^\]]*)\]")

# Primitives whose params hold jaxprs or computations typed for the traced dtypes (generic
# reduce/reduce_window bodies): they run in the traced dtypes. So do primitives whose params
# declare their result types (callbacks, FFI calls), and scatters with a computation of the
# user's (`.at[].apply`), which the interpreter recognizes by their params. Scatters that set,
# add, multiply or take extremes are re-typed for the dtypes they run in.
PINNED = primitives.TYPED_COMPUTATIONS


@dataclasses.dataclass(frozen=True)
class Region:
    """The autocast state that applies to an equation.

    Attributes:
      enabled: autocast on. Off: ops run in the dtypes the program was traced with (so values
        autocast lowered are cast back, e.g. to float32), or, with `as_is`, in their inputs'
        current types (torch's behaviour, used for `custom_fwd(cast_inputs=...)` bodies).
      dtype: the low dtype of `LOWER` ops.
      table: the op table.
      as_is: see `enabled`.
      cast_inputs: inside `custom_fwd(cast_inputs=...)`, the dtype its inputs are cast to.
      forward: for a custom_vjp bwd, the region of its forward (restored by `custom_bwd`).
      entry_dtype: inside a module a precision rule sets to a dtype: values autocast lowered
        to another dtype are read in this one (see `entered`).
      scope: where the equations of a jaxpr evaluated in this region sit, as the precision
        rules see it (`jamp.transforms.rules.Scope`); None without rules.
      kernel: inside a function a rule makes one torch kernel
        (`jamp.policy.autocast_tables.Kernel`): its rule, `FP32`, `LOWER` or `PROMOTE`;
        else None.
      rounded: the kernel's results leave it rounded to the widest dtype it reads
        (`Kernel.rounded`).
      fp8: inside a module a precision rule (or the transform's dtype) sets to an fp8 recipe
        (`jamp.fp8.Recipe`): its linear layers' products run through `jamp.fp8`; else None.
      fp8_every: set by a function rule: every matmul and convolution in the function runs
        through `jamp.fp8`, products of two activations (attention's) included.
      backward: in a backward pass the traced function runs itself (its own `jax.grad`),
        bodies of calls in it included: no product runs through `jamp.fp8` (see
        `jamp.transforms.autocast_fp8`).
    """

    enabled: bool
    dtype: np.dtype
    table: OpTable
    as_is: bool = False
    cast_inputs: np.dtype | None = None
    forward: "Region | None" = None
    entry_dtype: np.dtype | None = None
    scope: Any = None
    kernel: str | None = None
    rounded: bool = False
    fp8: Any = None
    fp8_every: bool = False
    backward: bool = False

    def off_as_is(self) -> "Region":
        """The state of a custom_vjp bwd: autocast off, ops in their inputs' types (no
        precision rule applies inside, as no region does)."""
        return dataclasses.replace(self, enabled=False, as_is=True, cast_inputs=None,
                                   forward=self, entry_dtype=None, scope=None, kernel=None,
                                   rounded=False, fp8=None, fp8_every=False)


def marker(**fields) -> str:
    """The scope name of a region; fields left as None are inherited from the outer region."""
    parts = []
    for key, value in fields.items():
        if value is None:
            continue
        if isinstance(value, bool):
            value = int(value)
        elif isinstance(value, np.dtype):
            value = value.name
        parts.append(f"{key}={value}")
    return f"{MARKER_PREFIX}[{','.join(parts)}]"


def parse_markers(stack_text: str) -> tuple[tuple[tuple[str, str], ...], ...]:
    """The markers in a name stack's text, outermost first."""
    if MARKER_PREFIX not in stack_text:
        return ()
    found = []
    for body in _MARKER_RE.findall(stack_text):
        fields = tuple(tuple(part.split("=", 1)) for part in body.split(",") if "=" in part)
        found.append(fields)
    return tuple(found)


def sets_its_own_dtype(fields) -> bool:
    """Whether a region marker's `fields` (a `jamp.autocast` region's) set the dtype or turn
    autocast on or off: what it sets replaces what the region around it set."""
    return bool({"device", "dtype", "enabled"} & dict(fields).keys())


def apply_markers(region: Region, markers) -> Region:
    """Folds a name stack's markers, outermost first, onto the enclosing region."""
    for fields in markers:
        fields = dict(fields)
        if "restore" in fields:
            region = region.forward or region
            continue
        changes: dict[str, Any] = {}
        if "device" in fields:
            changes["table"] = autocast_table(fields["device"])
            changes["dtype"] = changes["table"].default_dtype
        if "dtype" in fields:
            changes["dtype"] = np.dtype(fields["dtype"])
        if "enabled" in fields:
            changes["enabled"] = fields["enabled"] == "1"
            changes["as_is"] = fields.get("as_is") == "1"
        if sets_its_own_dtype(fields):
            changes["entry_dtype"] = None  # a region inside a ruled module sets its own
        if {"device", "dtype"} & fields.keys():
            # A region that names its dtype runs in it, also inside an fp8 module.
            changes.update(fp8=None, fp8_every=False)
        if "cast_inputs" in fields:
            # Outside an enabled region custom_fwd is a no-op (torch).
            changes["cast_inputs"] = np.dtype(fields["cast_inputs"]) if region.enabled else None
        region = dataclasses.replace(region, **changes)
    return region


def is_castable(dtype) -> bool:
    """float16, bfloat16 or float32: the dtypes autocast casts between (`dtype` is a numpy or
    JAX extended dtype, or None); float64 and float8 types are never touched."""
    return dtype is not None and dtype in AUTOCAST_DTYPES


def widest(dtypes: Iterable[Any]) -> Any:
    """The promotion of `dtypes` (None when there are none)."""
    result = None
    for d in dtypes:
        result = d if result is None else np.dtype(jnp.promote_types(result, d))
    return result


@dataclasses.dataclass(frozen=True)
class Operand:
    """What the rules need to know of one input of an equation.

    Attributes:
      current: its dtype now (after earlier casts); None when it is not floating.
      traced: its dtype in the traced program; None when it is not floating.
      follows: Python-scalar-like (a rank-0 literal, a weak-typed value) or a bias added to a
        matmul's result: it takes the dtype of the other operands and never widens them.
      constant: for a value known to be a constant of the program, its largest finite
        magnitude as a numpy scalar of the traced dtype; else None.
    """

    current: np.dtype | None
    traced: np.dtype | None
    follows: bool = False
    constant: np.generic | None = None

    @property
    def castable(self) -> bool:
        return is_castable(self.current) and is_castable(self.traced)


def input_targets(primitive_name: str, region: Region, operands: Sequence[Operand], *,
                  float32: bool = False, traced_only: bool = False,
                  wide_values: bool = False, scalar_result: bool = False,
                  kernel: np.dtype | None = None) -> list[np.dtype | None]:
    """The dtype each input is cast to (None: left as is).

    Args:
      primitive_name: the equation's primitive.
      region: the autocast state of the equation.
      operands: one per input.
      float32: the equation computes operands of a float32 op (see `float32_equations`).
      traced_only: the equation must see its traced dtypes (its params declare them).
      wide_values: an input or result is float64 or complex: the op runs as the program wrote
        it, so a float32 operand is never rounded down to meet a float64 one, and the parts of
        a complex number (`lax.complex`, which takes float32 or float64) keep their type.
      scalar_result: the equation sums arrays to one number (`OpTable.scalar_results`).
      kernel: inside a torch kernel (`Region.kernel`), its dtype: every input is cast to it,
        whatever chain the equation sits on.
    """
    castable = [o.castable for o in operands]
    traced = [o.traced for o in operands]
    if region.enabled and region.entry_dtype is not None:
        # A castable operand has both dtypes.
        operands = [dataclasses.replace(o, current=entered(
                        region, cast(np.dtype, o.current), cast(np.dtype, o.traced)))
                    if ok else o for o, ok in zip(operands, castable, strict=True)]
    if (traced_only or wide_values or primitive_name in PINNED
            or (not region.enabled and not region.as_is)):
        return [t if ok else None for ok, t in zip(castable, traced, strict=True)]
    if float32 and region.enabled and kernel is None:
        return [FLOAT32 if ok else None for ok in castable]
    fixed = kernel if kernel is not None else _fixed_dtype(primitive_name, region, scalar_result)
    if fixed is not None and not any(
            ok and overflows(o.constant, fixed) for ok, o in zip(castable, operands, strict=True)):
        return [fixed if ok else None for ok in castable]
    if primitive_name in primitives.SCATTERS:
        # A scatter runs in the dtype of its destination and values together (torch's
        # index_put, index_copy and scatter_add promote): a constant destination leads too, so
        # a gather's gradient accumulates into its float32 zeros.
        operands = [dataclasses.replace(operands[0], follows=False), *operands[1:]]
    # A constant the low dtype cannot represent saturates at its finite range (its nearest
    # value) in an op that passes it through; any other op computes in the constant's dtype.
    return _promote(operands, castable, saturate=primitive_name in primitives.SELECTIONS)


def entered(region: Region, current: np.dtype, traced: np.dtype) -> np.dtype:
    """The dtype a value is read in, inside a module a precision rule sets to a dtype
    (`Region.entry_dtype`): a value autocast lowered (narrower than its traced dtype) is read in
    the module's dtype, so that the module computes in it (a float32 rule reads the activations
    lowered before it in float32). Values the program typed itself are read as they are."""
    target = region.entry_dtype if region.enabled else None
    if target is None or current == target or (
            jnp.finfo(current).bits >= jnp.finfo(traced).bits):
        return current
    return target


def overflows(constant: np.generic | None, dtype: np.dtype) -> bool:
    """True when a finite constant rounds to infinity in `dtype`."""
    if constant is None:
        return False
    with np.errstate(over="ignore"):
        return bool(np.isfinite(constant) and not np.isfinite(constant.astype(dtype)))


def finite_range(dtype: np.dtype) -> tuple[np.generic, np.generic]:
    """The smallest and largest finite values of a floating dtype (where constants saturate)."""
    info = jnp.finfo(dtype)
    scalar = np.dtype(dtype).type
    return scalar(info.min), scalar(info.max)


def _fixed_dtype(primitive_name: str, region: Region, scalar_result: bool = False
                 ) -> np.dtype | None:
    if not region.enabled:
        return None
    rule = region.table.rule(primitive_name, scalar_result)
    if rule is None or rule == ACCUMULATE_FP32:
        return None
    if rule == LOWER:
        return region.dtype
    if rule in (FP32, FP32_STATISTICS):
        return FLOAT32
    return np.dtype(rule)


def accumulates_in_fp32(primitive_name: str, region: Region, scalar_result: bool = False
                        ) -> bool:
    """True for ops that compute in float32 and return their inputs' dtype."""
    return region.enabled and region.table.rule(primitive_name, scalar_result) == ACCUMULATE_FP32


def _promote(operands: Sequence[Operand], castable, saturate: bool) -> list[np.dtype | None]:
    # Inputs traced with the same dtype must agree again (the op was typed for that); each such
    # group runs in the widest current dtype of its non-scalar members. A scalar-like constant
    # the group's dtype cannot represent leads too (the op computes in the constant's dtype),
    # unless the op only selects it (`saturate`): then it is cast to its nearest finite value.
    groups: dict[np.dtype, list[int]] = {}
    for i, ok in enumerate(castable):
        if ok:
            groups.setdefault(np.dtype(operands[i].traced), []).append(i)
    targets: list[np.dtype | None] = [None] * len(operands)
    for members in groups.values():
        # Scalar-like values among themselves (weak-typed inputs, say) agree on their widest.
        leaders = ([operands[i].current for i in members if not operands[i].follows]
                   or [operands[i].current for i in members])
        target = widest(leaders)
        if not saturate:
            target = widest([target] + [operands[i].current for i in members
                                        if overflows(operands[i].constant, target)])
        for i in members:
            targets[i] = target
    return targets


__all__ = [
    "accumulates_in_fp32", "apply_markers", "entered", "finite_range",
    "input_targets", "is_castable", "marker", "MARKER_PREFIX", "Operand",
    "overflows", "parse_markers", "PINNED", "Region", "sets_its_own_dtype", "widest"
]
