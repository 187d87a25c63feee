"""A JAX trace (the XSpace `jax.profiler` writes) read back as `FunctionEvent`s.

Three kinds of events come out:
- ops: every event of the trace that names an HLO instruction (`hlo_op`, `hlo_module`,
  `program_id` stats): the CPU backend's thunks and a GPU's kernels and launches. Their shapes,
  FLOPs, scope path and source lines come from the compiled program (`hlo.ProgramCatalog`).
- program runs: the ops of one execution of a compiled program (the trace's `run_id`), spanned
  from the first op's start to the last op's end.
- ranges: the labels `record_function`, `emit_nvtx` and `emit_itt` opened on the host, as
  recorded, and their labels inside jitted code (named scopes) as the ops that ran under them.
"""

from __future__ import annotations

import dataclasses
import re
import warnings
from typing import Any, Iterable

from jamp.profile import hlo
from jamp.profile.events import CPU, EventList, FunctionEvent

# Device planes of an XSpace and the device type torch would call them.
_DEVICE_PLANES = (("/device:GPU", "cuda"), ("/device:TPU", "tpu"))
_HOST_PLANE = "/host:CPU"
# Annotations encoded as `Label:#key=value,...#`, in an event's name or in a string stat: XLA's
# GPU runtime annotates kernels with their module (`XlaModule:#hlo_module=...,program_id=...#`)
# and op, which a device event may carry as a stat rather than as stats of its own.
_ENCODED_STATS = re.compile(r"#([^#]*)#")


@dataclasses.dataclass(frozen=True)
class Options:
    """What a profile records beyond names and times (torch's keywords)."""

    record_shapes: bool = False
    with_flops: bool = False
    profile_memory: bool = False
    with_stack: bool = False
    with_modules: bool = False
    use_cpu: bool = True


@dataclasses.dataclass
class _Raw:
    name: str
    thread: str
    device_type: str
    start_ns: float
    end_ns: float
    stats: dict


def read_events(data, options: Options, host_labels: Iterable[str],
                scope_labels: Iterable[str], device_type_of_gpu: str = "cuda",
                hidden_modules: Iterable[str] = ()) -> tuple[EventList, str | None]:
    """The events of a `jax.profiler.ProfileData` and the name of the device it saw, if any.
    The ops of `hidden_modules` (the profiler's own programs) are left out."""
    hidden_modules = set(hidden_modules)
    raw = [r for r in _raw_events(data, device_type_of_gpu)
           if str(r.stats.get("hlo_module", "")) not in hidden_modules]
    if not raw:
        return EventList(), None
    origin = min(r.start_ns for r in raw)
    device_name = next((r.device_type for r in raw if r.device_type != CPU), None)
    host_labels, scope_labels = set(host_labels), set(scope_labels)
    op_raw = [r for r in raw if "hlo_op" in r.stats and "hlo_module" in r.stats]
    catalog = hlo.ProgramCatalog({(r.stats["hlo_module"], int(r.stats.get("program_id", 0)))
                                  for r in op_raw})
    events: list[FunctionEvent] = []

    def new(name, kind, thread, start_ns, end_ns, device_type=CPU) -> FunctionEvent:
        event = FunctionEvent(id=len(events), name=name, kind=kind, thread=thread,
                              start_us=(start_ns - origin) / 1e3,
                              end_us=(end_ns - origin) / 1e3, device_type=device_type)
        events.append(event)
        return event

    ops = []
    for r in op_raw:
        module, op = str(r.stats["hlo_module"]), str(r.stats["hlo_op"])
        # One run per launch and device: a sharded program runs on each of its devices.
        program = (module, int(r.stats.get("program_id", 0)), r.stats.get("run_id"),
                   r.stats.get("device_ordinal"))
        event = new(f"{module}::{op}", "op", r.thread, r.start_ns, r.end_ns, r.device_type)
        event.program = program
        _describe(event, catalog.instruction(module, program[1], op), options)
        ops.append(event)
    # Device work the trace does not tie to an HLO op (a library kernel outside XLA's
    # annotations) is still time on the device: a row named by the kernel.
    for r in raw:
        if r.device_type != CPU and not ("hlo_op" in r.stats and "hlo_module" in r.stats):
            new(r.name, "op", r.thread, r.start_ns, r.end_ns, r.device_type)
    _nest_on_threads(ops)

    runs: dict[tuple, list[FunctionEvent]] = {}
    for event in ops:
        runs.setdefault(event.program, []).append(event)
    programs = []
    for (module, program_id, run_id, device), members in runs.items():
        if run_id is None:  # without the trace's run ids, runs cannot be told apart
            continue
        run = new(module, "program", "XLA programs", 0, 0)
        run.start_us = min(e.start_us for e in members)
        run.end_us = max(e.end_us for e in members)
        run.program = (module, program_id, run_id, device)
        run.children = [e for e in members if e.parent is None]
        for child in run.children:
            child.parent = run
        compiled = catalog.program(module, program_id)
        if options.profile_memory and compiled is not None:
            # A run allocates its temporaries and outputs once; its ops write into them.
            own = compiled.temp_bytes + compiled.output_bytes
            if any(e.is_device for e in members):
                run.device_memory_usage = own
            else:
                run.cpu_memory_usage = own
        programs.append(run)

    ranges = [new(r.name, "range", r.thread, r.start_ns, r.end_ns)
              for r in raw if r.device_type == CPU and r.name in host_labels
              and "hlo_op" not in r.stats]
    _nest_on_threads(ranges)
    for run in programs:  # a program run belongs to the innermost range it started in
        holders = [r for r in ranges if r.start_us <= run.start_us <= r.end_us]
        if holders:
            holder = max(holders, key=lambda r: r.start_us)
            holder.children.append(run)
            run.parent = holder
    if options.profile_memory:
        _include_children_memory([e for e in events if e.parent is None])
    for label in scope_labels:
        events.extend(_scope_ranges(label, ops, len(events)))
    if not options.use_cpu:
        if events and not any(e.is_device for e in events):
            warnings.warn("profile(use_cpu=False) keeps device events only, and this trace has "
                          "none (no GPU or TPU ran): the profile is empty.", stacklevel=3)
        events = [e for e in events if e.is_device]
        for event in events:  # their CPU-side parents are gone with the rest
            if event.parent is not None and not event.parent.is_device:
                event.parent = None
    events.sort(key=lambda e: (e.start_us, -e.end_us))
    for index, event in enumerate(events):
        event.id = index
    return EventList(events, device_name=device_name, with_flops=options.with_flops,
                     profile_memory=options.profile_memory,
                     with_stack=options.with_stack), device_name


def _raw_events(data, device_type_of_gpu: str):
    for plane in data.planes:
        device_type = None
        if plane.name == _HOST_PLANE:
            device_type = CPU
        for prefix, kind in _DEVICE_PLANES:
            if plane.name.startswith(prefix):
                device_type = device_type_of_gpu if kind == "cuda" else kind
        if device_type is None:
            continue
        for line in plane.lines:
            thread = f"{plane.name}/{line.name}" if device_type != CPU else line.name
            for event in line.events:
                name = event.name
                if name.startswith("end: "):  # the end of an asynchronous step, not a step
                    continue
                stats = _with_encoded_stats(name, dict(event.stats))
                yield _Raw(name, thread, device_type, event.start_ns,
                           event.start_ns + event.duration_ns, stats)


def _with_encoded_stats(name: str, stats: dict) -> dict:
    """`stats` with the `#key=value,...#` annotations of the name and string stats added
    (stats of the event's own win)."""
    found: dict[str, Any] = {}
    for text in (name, *(v for v in stats.values() if isinstance(v, str))):
        for block in _ENCODED_STATS.findall(text):
            found.update(part.split("=", 1) for part in block.split(",") if "=" in part)
    return {**found, **stats}


def _describe(event: FunctionEvent, instruction: hlo.Instruction | None,
              options: Options) -> None:
    """Fills what the compiled program says about an op event, as the options ask."""
    if instruction is None:
        return
    event.scope = instruction.scope
    if options.record_shapes:
        event.input_shapes = instruction.input_shapes
        event.input_dtypes = instruction.input_dtypes
    if options.with_flops:
        event.flops = instruction.flops
    if options.with_stack:
        event.stack = instruction.stack
    if options.with_modules:
        event.module_hierarchy = instruction.module_hierarchy
    if options.profile_memory:
        if event.is_device:
            event.device_memory_usage = instruction.output_bytes
        else:
            event.cpu_memory_usage = instruction.output_bytes


def _include_children_memory(roots: list[FunctionEvent]) -> None:
    """Makes each event's memory inclusive, as torch's `cpu_memory_usage` is: what it
    allocates itself plus its children's (so `self_cpu_memory_usage` is its own)."""
    for event in roots:
        _include_children_memory(event.children)
        event.cpu_memory_usage += sum(c.cpu_memory_usage for c in event.children)
        event.device_memory_usage += sum(c.device_memory_usage for c in event.children)


def _nest_on_threads(events: list[FunctionEvent]) -> None:
    """Parents each event to the innermost event of its thread that encloses it."""
    by_thread: dict[str, list[FunctionEvent]] = {}
    for event in events:
        by_thread.setdefault(event.thread, []).append(event)
    for members in by_thread.values():
        members.sort(key=lambda e: (e.start_us, -e.end_us))
        open_events: list[FunctionEvent] = []
        for event in members:
            while open_events and open_events[-1].end_us < event.end_us:
                open_events.pop()
            if open_events:
                event.parent = open_events[-1]
                open_events[-1].children.append(event)
            open_events.append(event)


def _scope_ranges(label: str, ops: list[FunctionEvent], first_id: int) -> list[FunctionEvent]:
    """A label opened inside jitted code, once per program run: the ops that ran under it
    (its name is a run of components of their scope path; a label may hold a "/"). Its CPU
    and device times are theirs."""
    under = {id(op) for op in ops if f"/{label}/" in f"/{op.scope}/"}

    def counted_by_an_enclosing_op(op) -> bool:  # a while loop's body ops, under the label
        parent = op.parent
        while parent is not None and parent.kind == "op":
            if id(parent) in under:
                return True
            parent = parent.parent
        return False

    runs: dict[tuple, list[FunctionEvent]] = {}
    for op in ops:
        if id(op) in under and not counted_by_an_enclosing_op(op):
            runs.setdefault(op.program, []).append(op)
    found: list[FunctionEvent] = []
    for members in runs.values():
        event = _ScopeRange(id=first_id + len(found), name=label, kind="range",
                            thread=f"label {label}", start_us=min(e.start_us for e in members),
                            end_us=max(e.end_us for e in members))
        event.members = members
        # Inside its program run (not among the run's children: its ops are already there).
        event.parent = _enclosing_run(members[0])
        found.append(event)
    return found


def _enclosing_run(op: FunctionEvent) -> FunctionEvent | None:
    while op is not None and op.kind != "program":
        op = op.parent
    return op


@dataclasses.dataclass
class _ScopeRange(FunctionEvent):
    """A label inside jitted code: its times are the sums of its ops' (which may have run on
    several threads), so it has no time of its own."""

    members: list = dataclasses.field(default_factory=list, repr=False)

    @property
    def cpu_time_total(self) -> float:
        return sum(e.cpu_time_total for e in self.members)

    @property
    def self_cpu_time_total(self) -> float:
        return 0.0

    @property
    def device_time_total(self) -> float:
        return sum(e.device_time_total for e in self.members)


__all__ = ["Options", "read_events"]
