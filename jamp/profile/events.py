"""The profiler's results in torch's shapes: `FunctionEvent`, `FunctionEventAvg`, `EventList`.

Times are in microseconds and memory in bytes, as torch keeps them. An event ran on the CPU
(`device_type="cpu"`: host ranges, the CPU backend's XLA thunks, GPU kernel launches) or on a
device (`"cuda"`, `"rocm"`, `"tpu"`: kernels, read from the device planes of the trace).
"""

from __future__ import annotations

import dataclasses
import json
import numbers
from typing import Any, Iterable, Sequence

from jamp import _checks

CPU = "cpu"

# What torch's `table(sort_by=...)` and `export_stacks(metric=...)` accept.
SORT_KEYS = ("cpu_time", "cuda_time", "device_time", "cpu_time_total", "cuda_time_total",
             "device_time_total", "self_cpu_time_total", "self_cuda_time_total",
             "self_device_time_total", "count", "cpu_memory_usage", "self_cpu_memory_usage",
             "cuda_memory_usage", "self_cuda_memory_usage", "device_memory_usage",
             "self_device_memory_usage", "flops")
STACK_METRICS = ("self_cpu_time_total", "self_cuda_time_total", "self_device_time_total")


class _DeviceAliases:
    """torch's older names for the device columns (`cuda_*`), read through the new ones, so
    that a subclass's own times (a label inside jit) hold for both. (The new names are each
    subclass's fields or properties, hence the type checker's ignores below.)"""

    @property
    def cuda_time(self) -> float:
        return self.device_time  # type: ignore[attr-defined]

    @property
    def cuda_time_total(self) -> float:
        return self.device_time_total  # type: ignore[attr-defined]

    @property
    def self_cuda_time_total(self) -> float:
        return self.self_device_time_total  # type: ignore[attr-defined]

    @property
    def cuda_memory_usage(self) -> int:
        return self.device_memory_usage  # type: ignore[attr-defined]

    @property
    def self_cuda_memory_usage(self) -> int:
        return self.self_device_memory_usage  # type: ignore[attr-defined]


@dataclasses.dataclass
class FunctionEvent(_DeviceAliases):
    """One recorded event: an HLO op that ran, a program run, or a labelled range.

    Attributes:
      id: position in the profile.
      name: the key it is averaged under: `module::op` for an HLO op (`jit_step::fusion.3`),
        the module for a program run (`jit_step`), the label for a range.
      kind: "op", "program" or "range".
      thread: the trace line (thread or stream) it ran on.
      start_us, end_us: when, in microseconds from the start of the profile.
      device_type: "cpu", or the device it ran on.
      input_shapes, input_dtypes: the op's operands (with `record_shapes`).
      stack: `file(line): function` frames, innermost first (with `with_stack`).
      module_hierarchy: the named-scope path (Flax module path) of the op (with `with_modules`).
      flops: matmul and convolution FLOPs (with `with_flops`).
      cpu_memory_usage, device_memory_usage: bytes the event's results take (with
        `profile_memory`): an op's outputs; a program run's outputs and temporaries.
    """

    id: int
    name: str
    kind: str
    thread: str
    start_us: float
    end_us: float
    device_type: str = CPU
    input_shapes: list = dataclasses.field(default_factory=list)
    input_dtypes: list = dataclasses.field(default_factory=list)
    stack: tuple = ()
    module_hierarchy: str = ""
    flops: int = 0
    cpu_memory_usage: int = 0
    device_memory_usage: int = 0
    children: list = dataclasses.field(default_factory=list, repr=False)
    parent: Any = dataclasses.field(default=None, repr=False)
    program: tuple = dataclasses.field(default=(), repr=False)
    scope: str = dataclasses.field(default="", repr=False)

    @property
    def key(self) -> str:
        return self.name

    @property
    def duration_us(self) -> float:
        return self.end_us - self.start_us

    @property
    def is_device(self) -> bool:
        return self.device_type != CPU

    @property
    def cpu_time_total(self) -> float:
        return 0.0 if self.is_device else self.duration_us

    @property
    def device_time_total(self) -> float:
        own = self.duration_us if self.is_device else 0.0
        return own + sum(c.device_time_total for c in self.children if not c.is_device) + sum(
            c.duration_us for c in self.children if c.is_device)

    @property
    def self_cpu_time_total(self) -> float:
        """Its CPU time that no child covers. Children on other threads (a range's program
        runs, a run's ops) may overlap each other or outlast the event: only the part of its
        own time they cover is taken off, so self time is never negative."""
        if self.is_device:
            return 0.0
        return self.cpu_time_total - _covered(
            self.start_us, self.end_us, [c for c in self.children if not c.is_device])

    @property
    def self_device_time_total(self) -> float:
        return self.duration_us if self.is_device else 0.0

    # torch's per-call columns: one event is one call.
    count = 1

    @property
    def cpu_time(self) -> float:
        return self.cpu_time_total

    @property
    def device_time(self) -> float:
        return self.device_time_total

    @property
    def self_cpu_memory_usage(self) -> int:
        return self.cpu_memory_usage - sum(c.cpu_memory_usage for c in self.children)

    @property
    def self_device_memory_usage(self) -> int:
        return self.device_memory_usage - sum(c.device_memory_usage for c in self.children)


def _covered(start: float, end: float, children: Sequence[FunctionEvent]) -> float:
    """How much of [start, end] the children's intervals cover together."""
    total, reached = 0.0, start
    for child in sorted(children, key=lambda c: c.start_us):
        low, high = max(child.start_us, reached), min(child.end_us, end)
        if high > low:
            total += high - low
            reached = high
    return total


# What an average sums of its events.
_SUMMED = ("cpu_time_total", "self_cpu_time_total", "device_time_total", "self_device_time_total",
           "cpu_memory_usage", "self_cpu_memory_usage", "device_memory_usage",
           "self_device_memory_usage", "flops")


@dataclasses.dataclass
class FunctionEventAvg(_DeviceAliases):
    """The events of one key (and input shape, or stack prefix, when grouped by them), summed.

    Fields as torch's: `count`, `cpu_time_total`, `self_cpu_time_total`, `device_time_total`,
    `self_device_time_total`, memory, `flops`; `cpu_time` and `device_time` are per call.
    """

    key: str
    cpu_count: int = 0
    cpu_time_total: float = 0.0
    self_cpu_time_total: float = 0.0
    device_time_total: float = 0.0
    self_device_time_total: float = 0.0
    cpu_memory_usage: int = 0
    self_cpu_memory_usage: int = 0
    device_memory_usage: int = 0
    self_device_memory_usage: int = 0
    flops: int = 0
    input_shapes: Any = None
    input_dtypes: Any = None
    stack: tuple = ()
    module_hierarchy: str = ""
    kind: str = ""
    device_type: str = CPU
    # The first event's parent, as torch's `cpu_parent`: `table(top_level_events_only=True)`
    # keeps the keys whose events are not inside another.
    parent: Any = dataclasses.field(default=None, repr=False)
    _device_count: int = 0

    def add(self, event: "FunctionEvent | FunctionEventAvg") -> "FunctionEventAvg":
        """Adds one event, or another average (torch's `add`); device events count as calls
        only where a key has no CPU event (a kernel is the device side of a launch already
        counted)."""
        if isinstance(event, FunctionEventAvg):
            self.cpu_count += event.cpu_count
            self._device_count += event._device_count
        elif event.is_device:
            self._device_count += 1
        else:
            self.cpu_count += 1
        if event.device_type != CPU:
            self.device_type = event.device_type
        for field in _SUMMED:
            setattr(self, field, getattr(self, field) + getattr(event, field))
        if not self.module_hierarchy:
            self.module_hierarchy = event.module_hierarchy
        self.kind = self.kind or event.kind
        return self

    @property
    def calls(self) -> int:
        return self.cpu_count or self._device_count

    @property
    def count(self) -> int:
        """Calls: the CPU-side events (a GPU kernel is the device side of a launch counted
        there), or the device events of a key that has only those."""
        return self.calls

    @property
    def cpu_time(self) -> float:
        return self.cpu_time_total / max(self.calls, 1)

    @property
    def device_time(self) -> float:
        return self.device_time_total / max(self.calls, 1)


class EventList(list):
    """A list of `FunctionEvent`s or `FunctionEventAvg`s with torch's `EventList` methods."""

    def __init__(self, events: Iterable = (), *, device_name: str | None = None,
                 with_flops: bool = False, profile_memory: bool = False,
                 with_stack: bool = False):
        super().__init__(events)
        self._device_name = device_name
        self._with_flops = with_flops
        self._profile_memory = profile_memory
        self._with_stack = with_stack

    def _like(self, events) -> "EventList":
        return EventList(events, device_name=self._device_name, with_flops=self._with_flops,
                         profile_memory=self._profile_memory, with_stack=self._with_stack)

    @property
    def self_cpu_time_total(self) -> float:
        return sum(e.self_cpu_time_total for e in self)

    def key_averages(self, group_by_input_shape: bool = False,
                     group_by_stack_n: int = 0) -> "EventList":
        """One `FunctionEventAvg` per key (and per input shapes with `group_by_input_shape`,
        per the innermost `group_by_stack_n` frames of the stack), in first-seen order. As in
        torch, an average keeps a stack (and the table its "Source Location") only when
        grouped by one."""
        _checks.check_bool("group_by_input_shape", group_by_input_shape)
        group_by_stack_n = _checks.check_count("group_by_stack_n", group_by_stack_n, minimum=0)
        averages: dict[tuple, FunctionEventAvg] = {}
        for event in self:
            key = [event.key]
            if group_by_input_shape:
                key.append(str(event.input_shapes))
            if group_by_stack_n:
                key.append(tuple(event.stack[:group_by_stack_n]))
            average = averages.get(tuple(key))
            if average is None:
                average = averages[tuple(key)] = FunctionEventAvg(key=event.key,
                                                                  parent=event.parent)
                if group_by_input_shape:
                    average.input_shapes = event.input_shapes
                    average.input_dtypes = event.input_dtypes
            average.add(event)
            if group_by_stack_n:
                average.stack = tuple(event.stack[:group_by_stack_n])
        return self._like(averages.values())

    def total_average(self) -> FunctionEventAvg:
        """All events summed under the key "Total"."""
        total = FunctionEventAvg(key="Total")
        for event in self:
            total.add(event)
        # The total of every event describes none of them.
        total.kind, total.module_hierarchy, total.parent = "", "", None
        return total

    def table(self, sort_by: str | None = None, row_limit: int = 100,
              max_src_column_width: int = 75, max_name_column_width: int = 55,
              max_shapes_column_width: int = 80, header: str | None = None,
              top_level_events_only: bool = False, time_unit: str | None = None) -> str:
        """torch's profiler table: one row per event (or per key after `key_averages()`),
        sorted by `sort_by` (descending), at most `row_limit` rows (-1: all); "" when there
        are no events. The `max_*_column_width`s may be None: as wide as the widest entry."""
        if sort_by is not None and sort_by not in SORT_KEYS:
            raise ValueError(f"sort_by={sort_by!r} is not a column; accepted: "
                             f"{', '.join(SORT_KEYS)}")
        if time_unit is not None and time_unit not in ("s", "ms", "us"):
            raise ValueError(f"time_unit={time_unit!r}; accepted: 's', 'ms', 'us'")
        if row_limit is not None and (isinstance(row_limit, bool)
                                      or not isinstance(row_limit, numbers.Integral)):
            raise TypeError(f"row_limit must be an int (-1: every row), got "
                            f"row_limit={row_limit!r}")
        widths = dict(max_src_column_width=max_src_column_width,
                      max_name_column_width=max_name_column_width,
                      max_shapes_column_width=max_shapes_column_width)
        for name, value in widths.items():
            if value is not None:
                _checks.check_count(name, value, minimum=1)
        if header is not None and not isinstance(header, str):
            raise TypeError(f"header must be a str or None, got header={header!r}")
        _checks.check_bool("top_level_events_only", top_level_events_only)
        if not self:
            return ""
        from jamp.profile import table as table_module
        events = list(self)
        if top_level_events_only:
            events = [e for e in events if e.parent is None]
        if sort_by is not None:
            events.sort(key=lambda e: getattr(e, sort_by), reverse=True)
        if row_limit is not None and row_limit >= 0:
            events = events[:row_limit]
        return table_module.format_table(
            events, all_events=list(self), device_name=self._device_name,
            with_flops=self._with_flops, profile_memory=self._profile_memory,
            with_stack=self._with_stack, header=header, time_unit=time_unit,
            top_level_events_only=top_level_events_only, name_width=max_name_column_width,
            src_width=max_src_column_width, shapes_width=max_shapes_column_width)

    def __str__(self) -> str:
        return self.table()

    def export_chrome_trace(self, path) -> None:
        """Writes the events as Chrome's trace-event JSON (chrome://tracing, Perfetto)."""
        if self and not isinstance(self[0], FunctionEvent):
            raise ValueError("export_chrome_trace needs the profile's events, not their "
                             "key_averages()")
        trace = {"traceEvents": chrome_events(self), "displayTimeUnit": "ms"}
        with open(path, "w") as file:
            json.dump(trace, file)

    def export_stacks(self, path, metric: str = "self_cpu_time_total") -> None:
        """Writes `frame;frame;...;key value` lines (outermost frame first) for flame graph
        tools. Needs a profile recorded `with_stack=True`, as torch's does."""
        if metric not in STACK_METRICS:
            raise ValueError(f"metric={metric!r}; accepted: {', '.join(STACK_METRICS)}")
        if not self._with_stack:
            raise RuntimeError("export_stacks() requires a profile recorded with "
                               "with_stack=True: profile(with_stack=True).")
        lines = []
        for event in self:
            value = getattr(event, metric)
            if event.stack and value > 0:
                frames = ";".join(f.replace(";", ",") for f in reversed(event.stack))
                lines.append(f"{frames};{event.key} {int(value)}")
        with open(path, "w") as file:
            file.write("\n".join(lines) + ("\n" if lines else ""))


def chrome_events(events: Sequence[FunctionEvent]) -> list[dict]:
    """Complete ("X") trace events, one per event, named by its key; times in microseconds.
    Each thread or stream of the trace is its own track."""
    threads: dict[tuple, int] = {}
    rows = []
    for event in events:
        process = 1 if event.is_device else 0
        tid = threads.setdefault((process, event.thread), len(threads) + 1)
        args: dict[str, Any] = {"kind": event.kind}
        if event.input_shapes:
            args["Input Dims"] = event.input_shapes
            args["Input type"] = event.input_dtypes
        if event.flops:
            args["flops"] = event.flops
        if event.module_hierarchy:
            args["Module Hierarchy"] = event.module_hierarchy
        if event.stack:
            args["Call stack"] = ";".join(event.stack)
        rows.append({"name": event.key, "ph": "X", "cat": _category(event),
                     "ts": event.start_us, "dur": event.duration_us, "pid": process,
                     "tid": tid, "args": args})
    for (process, thread), tid in threads.items():
        rows.append({"name": "thread_name", "ph": "M", "pid": process, "tid": tid,
                     "args": {"name": thread}})
    for process, name in ((0, "CPU"), (1, "Device")):
        rows.append({"name": "process_name", "ph": "M", "pid": process,
                     "args": {"name": name}})
    return rows


def _category(event: FunctionEvent) -> str:
    if event.kind == "range":
        return "user_annotation"
    if event.is_device:
        return "kernel"
    return "cpu_op" if event.kind == "op" else "program"


__all__ = [
    "chrome_events", "CPU", "EventList", "FunctionEvent", "FunctionEventAvg", "SORT_KEYS",
    "STACK_METRICS"
]
