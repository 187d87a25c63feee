"""torch's profiler table, printed from `FunctionEvent`s or their averages.

Columns, widths and units are torch's: times as `12.345us` / `1.234ms` / `1.234s` (or in one
`time_unit`), memory as `24.00 KB`, FLOPs in one unit chosen for the column, "--" where an event
has none, and the footer `Self CPU time total: ...`.
"""

from __future__ import annotations

import math

_COLUMN = 12
_SPACING = 2
_FLOPS_UNITS = ("FLOPs", "KFLOPs", "MFLOPs", "GFLOPs", "TFLOPs", "PFLOPs")


def format_time(us: float, unit: str | None = None) -> str:
    if unit == "s":
        return f"{us / 1e6:.3f}s"
    if unit == "ms":
        return f"{us / 1e3:.3f}ms"
    if unit == "us":
        return f"{us:.3f}us"
    if abs(us) >= 1e6:
        return f"{us / 1e6:.3f}s"
    if abs(us) >= 1e3:
        return f"{us / 1e3:.3f}ms"
    return f"{us:.3f}us"


def format_share(us: float, total: float) -> str:
    return f"{us * 100.0 / total:.2f}%" if total else "0.00%" if us == 0 else "--"


def format_memory(nbytes: int) -> str:
    for size, unit in ((1024 ** 3, "GB"), (1024 ** 2, "MB"), (1024, "KB")):
        if abs(nbytes) >= size:
            return f"{nbytes / size:.2f} {unit}"
    return f"{nbytes} B"


def _flops_unit(smallest: int) -> tuple[float, str]:
    index = int(max(0, min(math.log10(smallest) / 3, len(_FLOPS_UNITS) - 1)))
    return 10.0 ** (-3 * index), _FLOPS_UNITS[index]


def _trim_path(path: str, width: int) -> str:
    return path if len(path) <= width else "..." + path[len(path) - width + 3:]


def _calls(event) -> int:
    return getattr(event, "calls", 1)


def _fit(widest: int, limit: int | None) -> int:
    return widest if limit is None else min(widest, limit)


def format_table(events, *, all_events, device_name, with_flops, profile_memory, with_stack,
                 header, time_unit, top_level_events_only, name_width, src_width,
                 shapes_width) -> str:
    """`events` as table rows; columns, widths and percentages are `all_events`' (the whole
    list, whatever `row_limit` and `top_level_events_only` left out), as torch's are."""
    has_device = any(e.device_time_total for e in all_events)
    device = (device_name or "device").upper()
    has_shapes = any(getattr(e, "input_shapes", None) for e in all_events)
    stacks = with_stack and any(e.stack for e in all_events)
    flops = [e.flops for e in all_events if e.flops > 0] if with_flops else []
    width = _fit(max(len(e.key) for e in all_events) + 4, name_width)
    shapes_width = _fit(max(len(str(getattr(e, "input_shapes", None) or []))
                            for e in all_events) + 4, shapes_width)
    src_width = _fit(max((len(f) for e in all_events for f in e.stack), default=0) + 4,
                     src_width)

    headers = ["Name", "Self CPU %", "Self CPU", "CPU total %", "CPU total", "CPU time avg"]
    if has_device:
        headers += [f"Self {device}", f"Self {device} %", f"{device} total",
                    f"{device} time avg"]
    if profile_memory:
        headers += ["CPU Mem", "Self CPU Mem"]
        if has_device:
            headers += [f"{device} Mem", f"Self {device} Mem"]
    headers.append("# of Calls")
    widths = [width] + [_COLUMN] * (len(headers) - 1)
    aligns = [">"] * len(headers)
    if has_shapes:
        headers.append("Input Shapes")
        widths.append(shapes_width)
        aligns.append(">")
    if stacks:
        headers.append("Source Location")
        widths.append(src_width)
        aligns.append("<")
    if flops:
        scale, unit = _flops_unit(min(flops))
        headers.append(f"Total {unit}")
        widths.append(_COLUMN)
        aligns.append(">")

    def row(values) -> str:
        return "".join(f"{str(v)[:w] if i == 0 else v:{a}{w}}" + " " * _SPACING
                       for i, (v, w, a) in enumerate(zip(values, widths, aligns, strict=True)))

    separator = "".join("-" * w + " " * _SPACING for w in widths)
    self_cpu_total = sum(e.self_cpu_time_total for e in all_events)
    self_device_total = sum(e.self_device_time_total for e in all_events)
    lines = []
    if header is not None:
        lines += ["=" * len(separator.rstrip()), header]
    if top_level_events_only:
        lines += ["=" * len(separator.rstrip()), "This report only displays top-level events"]
    lines += [separator, row(headers), separator]
    for event in events:
        name = event.key if len(event.key) <= width else event.key[:width - 3] + "..."
        values = [name,
                  format_share(event.self_cpu_time_total, self_cpu_total),
                  format_time(event.self_cpu_time_total, time_unit),
                  format_share(event.cpu_time_total, self_cpu_total),
                  format_time(event.cpu_time_total, time_unit),
                  format_time(event.cpu_time_total / max(_calls(event), 1), time_unit)]
        if has_device:
            values += [format_time(event.self_device_time_total, time_unit),
                       format_share(event.self_device_time_total, self_device_total),
                       format_time(event.device_time_total, time_unit),
                       format_time(event.device_time_total / max(_calls(event), 1), time_unit)]
        if profile_memory:
            values += [format_memory(event.cpu_memory_usage),
                       format_memory(event.self_cpu_memory_usage)]
            if has_device:
                values += [format_memory(event.device_memory_usage),
                           format_memory(event.self_device_memory_usage)]
        values.append(_calls(event))
        if has_shapes:
            values.append(str(event.input_shapes or [])[:widths[len(values)]])
        if stacks:
            values.append(_trim_path(event.stack[0], src_width) if event.stack else "")
        if flops:
            values.append(f"{event.flops * scale:8.3f}" if event.flops > 0 else "--")
        lines.append(row(values))
        if stacks:
            for frame in event.stack[1:]:
                lines.append(row([""] * (len(values) - 1 - bool(flops)) + [
                    _trim_path(frame, src_width)] + ([""] if flops else [])))
    lines.append(separator)
    lines.append(f"Self CPU time total: {format_time(self_cpu_total, time_unit)}")
    if has_device:
        lines.append(f"Self {device} time total: {format_time(self_device_total, time_unit)}")
    return "\n".join(lines) + "\n"


__all__ = ["format_memory", "format_share", "format_table", "format_time"]
