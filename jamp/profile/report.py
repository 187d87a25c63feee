"""`amp_report`: how much of a program runs in half precision, and what its casts cost.

The report is read from the program, before any accelerator time is spent: the function is
traced to a jaxpr (after `jamp.autocast` has put its casts in) and every equation, sub-programs
included, is counted by primitive and by Flax module, with the FLOPs of its matmuls and
convolutions and the bytes of its operands and results by dtype. The converts are those of the
lowered program; the compiled program adds XLA's own estimates of FLOPs, bytes accessed and
memory.

The count is `tally`'s, the converts `stablehlo_converts`'; this module holds the report: its
rows, its text table and its plot.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from jamp.policy.dtypes import HALF_DTYPES, is_fp8_dtype, is_half_dtype
from jamp.profile import stablehlo_converts
from jamp.profile.table import format_memory
from jamp.profile.tally import CONVERT, Stats, Tally
from jamp import _jax_internals as jx

TOP_LEVEL = "(top level)"
_HALF_NAMES = " or ".join(sorted((d.name for d in HALF_DTYPES), reverse=True))  # f16 first

# `jax.jit`'s wrapper type: an already jitted function is traced, lowered and compiled through
# its own caches, so a report on a training step a script already compiled compiles nothing.
_JITTED = type(jax.jit(lambda: None))


@dataclasses.dataclass(frozen=True)
class Row:
    """The equations of one primitive, or of one Flax module, and what they cost.

    Attributes:
      name: the primitive (`dot_general`) or the module path (`Model/Dense_0`, or
        `(top level)` for equations outside any named scope).
      static_count: equations in the program text (a `jax.jit` body called from several
        places is one function of the lowered program, and counted once, unless jax copies
        it into each caller, as it does `jax.jit(inline=True)` bodies).
      count: equations executed: a scan body's times its length, and so on.
      flops: matmul and convolution FLOPs executed, by compute dtype name.
      bytes: bytes of operands and results executed, by dtype name.
    """

    name: str
    static_count: int
    count: int
    flops: Mapping[str, int]
    bytes: Mapping[str, int]

    def to_dict(self) -> dict[str, Any]:
        return dict(name=self.name, static_count=self.static_count, count=self.count,
                    flops=dict(self.flops), bytes=dict(self.bytes))


@dataclasses.dataclass(frozen=True)
class Convert:
    """The conversions from one dtype to another that one primitive lowers to.

    Attributes:
      source, target: dtype names.
      primitive: `convert_element_type` for the casts in the program (autocast's among
        them), or the primitive whose lowering converts (`pow` converts an integer exponent).
      static_count: `stablehlo.convert` ops in the lowered program.
      count: executed.
      bytes: bytes written (the results), executed.
    """

    source: str
    target: str
    primitive: str
    static_count: int
    count: int
    bytes: int

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class CompiledStats:
    """What the lowered and compiled program say (None where the backend does not say).

    Attributes:
      flops: XLA's cost analysis: FLOPs of every op, not only matmuls.
      bytes_accessed: XLA's cost analysis: bytes read and written.
      memory: the compiled program's memory sizes in bytes (`argument`, `output`, `temp`,
        `alias`, `generated_code`).
      lowered_converts: the `stablehlo.convert` ops of the lowered program, counted in its
        text: the report's converts account for each of them.
    """

    flops: float | None
    bytes_accessed: float | None
    memory: Mapping[str, int] | None
    lowered_converts: int

    def to_dict(self) -> dict[str, Any]:
        return dict(flops=self.flops, bytes_accessed=self.bytes_accessed,
                    memory=None if self.memory is None else dict(self.memory),
                    lowered_converts=self.lowered_converts)


@dataclasses.dataclass(frozen=True)
class AmpReport:
    """What `amp_report` found. Printing it prints `table()`.

    Attributes:
      half_flops_fraction: the share of matmul and convolution FLOPs with float16 or
        bfloat16 operands (0.0 for a program without any).
      fp8_flops_fraction: the share with float8 operands: fp8 GEMMs, native or emulated (a
        float32 GEMM of float8 values cast back and divided by their scales, as `jamp.fp8`
        runs them where no float8 GEMM is lowered); they count under their float8 dtype.
      flops: matmul and convolution FLOPs executed, by compute dtype.
      bytes: bytes of operands and results executed, by dtype.
      primitives: a `Row` per primitive, most FLOPs (then bytes) first.
      modules: a `Row` per Flax module path, most FLOPs (then bytes) first.
      converts: a `Convert` per (source, target, primitive), most bytes first.
      compiled: the lowered and compiled program's own numbers.
    """

    half_flops_fraction: float
    fp8_flops_fraction: float
    flops: Mapping[str, int]
    bytes: Mapping[str, int]
    primitives: tuple[Row, ...]
    modules: tuple[Row, ...]
    converts: tuple[Convert, ...]
    compiled: CompiledStats

    @property
    def fp8_casts(self) -> tuple[Convert, ...]:
        """The converts to a float8 dtype (fp8 GEMMs' operand casts), most bytes first."""
        return tuple(c for c in self.converts if is_fp8_dtype(jnp.dtype(c.target)))

    @property
    def fp8_cast_bytes(self) -> int:
        """The bytes the casts to float8 write, executed."""
        return sum(c.bytes for c in self.fp8_casts)

    def to_dict(self) -> dict[str, Any]:
        """The report as plain Python (dicts, lists, strings and numbers): `json.dumps` takes
        it as it is."""
        return dict(
            half_flops_fraction=self.half_flops_fraction,
            fp8_flops_fraction=self.fp8_flops_fraction,
            fp8_casts=[c.to_dict() for c in self.fp8_casts], fp8_cast_bytes=self.fp8_cast_bytes,
            flops=dict(self.flops),
            bytes=dict(self.bytes), primitives=[r.to_dict() for r in self.primitives],
            modules=[r.to_dict() for r in self.modules],
            converts=[c.to_dict() for c in self.converts], compiled=self.compiled.to_dict())

    def table(self, row_limit: int | None = 20) -> str:
        """The report as text: a summary, then the primitives, modules and converts.

        Args:
          row_limit: the most rows shown per section; None or a negative number shows all
            (torch's profiler tables take -1).
        """
        if row_limit is not None and (isinstance(row_limit, bool)
                                      or not isinstance(row_limit, int)):
            raise TypeError(f"row_limit must be an int or None; got {row_limit!r}.")
        limit = None if row_limit is None or row_limit < 0 else row_limit
        compiled = self.compiled
        estimates = [f"{_flops(compiled.flops)} FLOPs" if compiled.flops is not None else "",
                     f"{format_memory(int(compiled.bytes_accessed))} accessed"
                     if compiled.bytes_accessed is not None else "",
                     f"{format_memory(compiled.memory.get('temp', 0))} temp memory"
                     if compiled.memory is not None else ""]
        lines = [
            f"half_flops_fraction {self.half_flops_fraction:.3f} (the share of matmul/conv "
            f"FLOPs in {_HALF_NAMES})",
            f"matmul/conv FLOPs: {_amounts(self.flops, _flops) or '0'}",
            f"bytes of operands and results: {_amounts(self.bytes, format_memory) or '0'}",
            f"converts: {sum(c.count for c in self.converts)} executed "
            f"({sum(c.static_count for c in self.converts)} in the lowered program), "
            f"{format_memory(sum(c.bytes for c in self.converts))} written",
            "compiled, XLA's estimates: " + (", ".join(e for e in estimates if e) or "none"),
        ]
        if self.fp8_flops_fraction or self.fp8_casts:
            lines.insert(1, f"fp8_flops_fraction {self.fp8_flops_fraction:.3f} (float8 "
                            f"operands), {sum(c.count for c in self.fp8_casts)} casts to float8 "
                            f"executed, {format_memory(self.fp8_cast_bytes)} written")
        header = ("count", "executed", "FLOPs", "bytes")
        for title, rows in (("primitive", self.primitives), ("module", self.modules)):
            cells = [(r.name, str(r.static_count), str(r.count), _amounts(r.flops, _flops),
                      _amounts(r.bytes, format_memory)) for r in rows[:limit]]
            lines += ["", *_columns([(title, *header), *cells], len(rows) - len(cells))]
        cells = [(f"{_short(c.source)} -> {_short(c.target)}", str(c.static_count),
                  str(c.count), format_memory(c.bytes), c.primitive)
                 for c in self.converts[:limit]]
        lines += ["", *_columns([("convert", "count", "executed", "written", "by"), *cells],
                                len(self.converts) - len(cells))]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    def plot(self, ax=None, quantity: str = "flops"):
        """A stacked bar per module of its FLOPs (or bytes) by dtype, with matplotlib.

        Args:
          ax: the matplotlib Axes to draw on; default: a new figure's.
          quantity: "flops" (matmul and convolution FLOPs) or "bytes".

        Returns:
          The Axes.
        """
        if quantity not in ("flops", "bytes"):
            raise ValueError(f"AmpReport.plot's quantity must be 'flops' or 'bytes'; got "
                             f"{quantity!r}.")
        try:
            import matplotlib.pyplot as plt
        except ImportError as e:
            raise ImportError("AmpReport.plot needs matplotlib: pip install matplotlib") from e
        amount = lambda r: sum(getattr(r, quantity).values())
        # barh draws the first row at the bottom: ascending puts the biggest on top.
        rows = sorted((r for r in self.modules if getattr(r, quantity)), key=amount)
        if ax is None:
            _, ax = plt.subplots(figsize=(8, 1.5 + 0.3 * len(rows)))
        left = np.zeros(len(rows))
        for dtype in sorted({d for r in rows for d in getattr(r, quantity)}):
            widths = np.array([getattr(r, quantity).get(dtype, 0) for r in rows], float)
            ax.barh([r.name for r in rows], widths, left=left, label=dtype)
            left += widths
        ax.set_xlabel("matmul/conv FLOPs" if quantity == "flops" else "bytes of operands and "
                      "results")
        ax.set_title(f"By dtype per module (half_flops_fraction "
                     f"{self.half_flops_fraction:.3f})")
        if rows:
            ax.legend()
        return ax


def amp_report(fn: Callable, *args: Any, **kwargs: Any) -> AmpReport:
    """Counts what `fn(*args, **kwargs)` runs, by primitive, Flax module and dtype.

    `fn` is anything `jax.jit` can trace: a plain function, a `jax.jit` one, a
    `jamp.autocast` one, a `jax.grad` of those, a whole training step. Its program is read as
    `jax.jit` lowers it (dead code left out), sub-programs included: jit, custom_jvp and
    custom_vjp bodies, checkpoint/remat, shard_map (its per-device body counted once per
    device), `scan` (its body's executed counts times its length), `while` (its body counted
    once: the trip count is not known before it runs), `cond` (every branch in the static
    counts, the most expensive branch in the executed ones).

    FLOPs are counted for matmuls and convolutions only: `dot_general` 2*batch*m*n*k,
    `conv_general_dilated` 2 * output size * kernel window * input features per group, under
    their operands' (compute) dtype, not `preferred_element_type` (the result type: a bfloat16
    matmul accumulating into float32 counts as bfloat16). Bytes count each equation's array
    operands and results under their own dtypes. Converts are the `stablehlo.convert` ops of
    the lowered program: the `convert_element_type` equations between two dtypes, and those
    that other primitives lower to (found by lowering each kind of equation on its own).

    Module rows come from the `jax.named_scope` names Flax linen gives each module's call
    (`Model/Dense_0`); an equation belongs to its innermost module (a parent's row leaves out
    its submodules'). Flax NNX modules do not name their calls: wrap a call in
    `jax.named_scope("...")` to get a row for it. Python scalars among the arguments are traced
    as `jax.jit` traces them: bind static ones with `functools.partial`.

    Args:
      fn: the function to report on.
      *args, **kwargs: its arguments (arrays or `jax.ShapeDtypeStruct`s).

    Returns:
      An `AmpReport`: `print` it for a table, `.to_dict()` for JSON.

    Raises:
      TypeError: `fn` is not callable.

    Example:
      >>> import jax, jax.numpy as jnp, jamp
      >>> from jamp.profile import amp_report
      >>> def mlp(w1, w2, x):
      ...     return jnp.mean(jnp.tanh(x @ w1) @ w2)
      >>> w1, w2, x = jnp.ones((16, 32)), jnp.ones((32, 4)), jnp.ones((8, 16))
      >>> amp_report(mlp, w1, w2, x).half_flops_fraction
      0.0
      >>> report = amp_report(jamp.autocast(mlp, dtype=jnp.bfloat16), w1, w2, x)
      >>> report.half_flops_fraction
      1.0
      >>> report.flops == {"bfloat16": 2 * 8 * 16 * 32 + 2 * 8 * 32 * 4}
      True
      >>> [(c.source, c.target, c.count) for c in report.converts]
      [('float32', 'bfloat16', 3), ('bfloat16', 'float32', 1)]
    """
    if not callable(fn):
        raise TypeError(f"amp_report's first argument must be a function to report on; got "
                        f"{fn!r} of type {type(fn).__name__}.")
    try:
        traced = (fn if isinstance(fn, _JITTED) else jax.jit(fn)).trace(*args, **kwargs)
    except TypeError as error:
        if "non-array argument" not in str(error):
            raise
        raise TypeError(
            f"amp_report traces fn as jax.jit does, and jax.jit refuses one of its arguments: "
            f"{error}\nBind arguments that are not arrays first, e.g. "
            f"amp_report(functools.partial(fn, option=value), *arrays).") from error
    tally = Tally()
    tally.walk(jx.without_dead_code(traced.jaxpr.jaxpr), (), 1)
    lowered = traced.lower()
    return _report(tally, stablehlo_converts.lowering_converts(tally.examples),
                   _compiled_stats(lowered.compile(),
                                   stablehlo_converts.converts_in(lowered.as_text())))


# -- the report -----------------------------------------------------------------------------

def _report(tally: Tally, lowering_converts: Mapping[Any, list], compiled) -> AmpReport:
    primitives: collections.defaultdict[str, Stats] = collections.defaultdict(Stats)
    modules: collections.defaultdict[str, Stats] = collections.defaultdict(Stats)
    converts: collections.defaultdict[tuple, Stats] = collections.defaultdict(Stats)
    for key, stats in tally.stats.items():
        if key[0] == "convert":
            _, source, target, _ = key
            converts[(source, target, CONVERT)].add(stats)
            continue
        _, name, path, lowering = key
        primitives[name].add(stats)
        modules["/".join(path) or TOP_LEVEL].add(stats)
        for source, target, size in lowering_converts.get(lowering, ()):
            extra = converts[(source, target, name)]
            extra.static += stats.static
            extra.count += stats.count
            extra.bytes[target] += size * stats.count
    total = Stats()
    for stats in primitives.values():
        total.add(stats)
    half = sum(n for dtype, n in total.flops.items() if is_half_dtype(jnp.dtype(dtype)))
    fp8 = sum(n for dtype, n in total.flops.items() if is_fp8_dtype(jnp.dtype(dtype)))
    all_flops = sum(total.flops.values())
    return AmpReport(
        half_flops_fraction=half / all_flops if all_flops else 0.0,
        fp8_flops_fraction=fp8 / all_flops if all_flops else 0.0,
        flops=_plain(total.flops), bytes=_plain(total.bytes),
        primitives=_rows(primitives), modules=_rows(modules),
        converts=tuple(sorted(
            (Convert(source, target, by, s.static, s.count, sum(s.bytes.values()))
             for (source, target, by), s in converts.items()),
            key=lambda c: (-c.bytes, -c.count, c.source, c.target, c.primitive))),
        compiled=compiled)


def _rows(stats: Mapping[str, Stats]) -> tuple[Row, ...]:
    rows = [Row(name, s.static, s.count, _plain(s.flops), _plain(s.bytes))
            for name, s in stats.items()]
    return tuple(sorted(rows, key=lambda r: (-sum(r.flops.values()), -sum(r.bytes.values()),
                                             -r.count, r.name)))


def _plain(counts: Mapping[str, int]) -> dict[str, int]:
    """Python ints by dtype, the largest first, zeros left out."""
    return {d: int(n) for d, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])) if n}


def _compiled_stats(compiled, lowered_converts: list) -> CompiledStats:
    """XLA's cost analysis and memory sizes of a `jax.stages.Compiled`."""
    try:
        cost = compiled.cost_analysis()
    except NotImplementedError:  # a backend without a cost model
        cost = None
    cost = cost or {}
    try:
        sizes = compiled.memory_analysis()
    except NotImplementedError:
        sizes = None
    memory = None if sizes is None else {
        key: int(getattr(sizes, f"{key}_size_in_bytes"))
        for key in ("argument", "output", "temp", "alias", "generated_code")
        if hasattr(sizes, f"{key}_size_in_bytes")}
    number = lambda v: None if v is None else float(v)
    return CompiledStats(number(cost.get("flops")), number(cost.get("bytes accessed")), memory,
                         len(lowered_converts))


# -- text -----------------------------------------------------------------------------------

_SI = ("", "k", "M", "G", "T", "P", "E")


def _flops(value: float) -> str:
    """`2.82G`: three significant digits and an SI prefix."""
    k = 0
    while abs(value) >= 1000 and k < len(_SI) - 1:
        value /= 1000
        k += 1
    return f"{value:.0f}" if k == 0 else f"{value:.3g}{_SI[k]}"


def _amounts(counts: Mapping[str, int], unit: Callable[[int], str]) -> str:
    """`1.05M bf16, 2.1k f32`: amounts by dtype, the largest first."""
    return ", ".join(f"{unit(n)} {_short(d)}" for d, n in counts.items())


def _short(dtype: str) -> str:
    for long, short in (("bfloat", "bf"), ("float", "f"), ("uint", "u"), ("int", "i"),
                        ("complex", "c")):
        if dtype.startswith(long):
            return short + dtype[len(long):]
    return dtype


def _columns(rows: list[tuple[str, ...]], hidden: int) -> list[str]:
    """Aligned columns, counts right-aligned; a last line says how many rows were cut."""
    widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
    lines = ["  ".join(cell.rjust(w) if c in (1, 2) else cell.ljust(w)
                       for c, (cell, w) in enumerate(zip(row, widths))).rstrip()
             for row in rows]
    if len(rows) == 1 and not hidden:
        lines.append("(none)")
    return lines + ([f"... {hidden} more (row_limit)"] if hidden else [])


__all__ = ["amp_report", "AmpReport", "CompiledStats", "Convert", "Row", "TOP_LEVEL"]
