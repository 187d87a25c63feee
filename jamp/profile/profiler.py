"""torch.autograd.profiler's surface over `jax.profiler`: `profile`, `record_function`,
`emit_nvtx`, `emit_itt`.

`profile` runs JAX's real profiler for the duration of its block and reads the trace back
(`trace.read_events`): what you get is what XLA recorded, each op joined to the compiled program
it belongs to. Nothing is timed in Python.
"""

from __future__ import annotations

import contextlib
import functools
import glob
import os
import shutil
import tempfile
import threading
from typing import Any, Callable, TypeVar, cast

import jax
import numpy as np

from jamp import _checks
from jamp.profile import trace
from jamp.profile.events import EventList, FunctionEventAvg
from jamp import _jax_internals as jx

_F = TypeVar("_F", bound=Callable[..., Any])

# Labels opened by `record_function` / `emit_nvtx` / `emit_itt`: on the host (trace events
# by that name are ranges) and inside traced code (named scopes, whose ops are the range).
# Names only; a jitted function may be traced long before the profile that runs it.
_HOST_LABELS: set[str] = set()
_SCOPE_LABELS: set[str] = set()
_ACTIVE = threading.Lock()


def _jamp_profile_barrier(x):
    return x + 1


# The profiler's own program (see `_wait_for_dispatched_work`); a profile leaves its ops out.
_BARRIER = jax.jit(_jamp_profile_barrier)
_BARRIER_MODULE = "jit__jamp_profile_barrier"


def _wait_for_dispatched_work() -> None:
    """Blocks until every program dispatched so far has run, so that a profile holds the
    work of its block, however it was dispatched. `jax.effects_barrier` waits only for side
    effects, and results nobody keeps cannot be blocked on; but a device runs its programs
    in the order they were dispatched, so a tiny one on each device ends after all of them."""
    if jx.staging():  # a profile opened inside jax.jit: nothing runs there
        return
    jax.effects_barrier()
    # A context mesh would refuse a one-device program; JAX lets it be unset only outside
    # transformations (inside an eager jax.grad, say). Under `jax.disable_jit` the barrier
    # would run as eager ops the profile could not tell from the user's.
    no_mesh = contextlib.nullcontext() if jx.tracing() else jax.set_mesh(None)
    with no_mesh, jax.disable_jit(False):
        done = [_BARRIER(jax.device_put(np.int32(0), device))
                for device in jax.local_devices()]
    jax.block_until_ready(done)


class profile:
    """Records what runs in its block with JAX's profiler; torch's `profile`.

    The block's work is in the profile whether or not it blocked on its results: entering
    waits for the work dispatched before (which stays out), leaving waits for the block's.

    Args:
      enabled: False makes the block run unprofiled: no trace, no cost.
      use_cuda: accepted for torch code; device times are reported whenever the trace has a
        device (JAX records GPU and TPU kernels itself).
      record_shapes: each op's operand shapes and dtypes (`input_shapes`, `input_dtypes`).
      with_flops: matmul and convolution FLOPs of each op, from the compiled program.
      profile_memory: bytes each op writes; a program run's outputs and temporaries.
      with_stack: the user's source lines of each op (`file(line): function`).
      with_modules: the named-scope path of each op: Flax linen module paths.
      use_kineto, experimental_config, use_device: accepted for torch code; JAX's profiler
        is the backend and reports the devices it saw.
      use_cpu: False keeps device events only.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jamp.profile import profile
      >>> def layer(w, x):
      ...     return jnp.tanh(x @ w)
      >>> f = jax.jit(layer)
      >>> w, x = jnp.ones((32, 32)), jnp.ones((8, 32))
      >>> _ = f(w, x).block_until_ready()   # compile outside the profile
      >>> with profile(with_flops=True) as prof:
      ...     for _ in range(3):
      ...         _ = f(w, x).block_until_ready()
      >>> rows = {e.key: e for e in prof.key_averages()}
      >>> rows["jit_layer"].count   # one row per program, one per HLO op ("jit_layer::...")
      3
      >>> sum(e.flops for e in prof.key_averages() if e.kind == "op") == 3 * 2 * 8 * 32 * 32
      True
    """

    def __init__(self, enabled: bool = True, *, use_cuda: bool = False,
                 record_shapes: bool = False, with_flops: bool = False,
                 profile_memory: bool = False, with_stack: bool = False,
                 with_modules: bool = False, use_kineto: bool = False, use_cpu: bool = True,
                 experimental_config: Any = None, use_device: str | None = None):
        flags = dict(enabled=enabled, use_cuda=use_cuda, record_shapes=record_shapes,
                     with_flops=with_flops, profile_memory=profile_memory,
                     with_stack=with_stack, with_modules=with_modules, use_kineto=use_kineto,
                     use_cpu=use_cpu)
        for name, value in flags.items():
            _checks.check_bool(name, value)
        if use_device is not None and not isinstance(use_device, str):
            raise TypeError(f"use_device must be a device type name such as 'cuda', or None; "
                            f"got use_device={use_device!r}")
        self.enabled = enabled
        self.use_cuda = use_cuda
        self.use_device = use_device
        self.experimental_config = experimental_config
        self.options = trace.Options(record_shapes=record_shapes, with_flops=with_flops,
                                     profile_memory=profile_memory, with_stack=with_stack,
                                     with_modules=with_modules, use_cpu=use_cpu)
        self.function_events: EventList | None = None
        self.device_name: str | None = None
        self._directory: str | None = None
        self._running = False

    def __enter__(self) -> "profile":
        if not self.enabled:
            self.function_events = EventList()
            return self
        if jx.staging():
            raise RuntimeError(
                "profile() records what runs, and nothing runs while jax.jit traces: profile "
                "the call to the jitted function instead (label parts of it with "
                "record_function).")
        if self._running or self.function_events is not None:
            raise RuntimeError("This profile has already run; make a new profile() for "
                               "another block.")
        if not _ACTIVE.acquire(blocking=False):
            raise RuntimeError("Another jamp profile is running; JAX records one trace at "
                               "a time, so profiles cannot be nested.")
        try:
            _wait_for_dispatched_work()  # what ran before the block stays out of it
        except BaseException:
            _ACTIVE.release()
            raise
        self._directory = tempfile.mkdtemp(prefix="jamp-profile-")
        options = jax.profiler.ProfileOptions()
        options.python_tracer_level = 0  # Python function events would swamp the host line
        try:
            jax.profiler.start_trace(self._directory, profiler_options=options)
        except Exception as error:
            _ACTIVE.release()
            shutil.rmtree(self._directory, ignore_errors=True)
            reason = str(error).rstrip(". ")
            raise RuntimeError(f"jax.profiler could not start a trace: {reason}. Is another "
                               "trace (jax.profiler.trace, start_trace) running?") from error
        self._running = True
        return self

    def __exit__(self, *exc_info) -> None:
        if not self._running:
            return
        self._running = False
        assert self._directory is not None  # set by __enter__
        try:
            try:
                _wait_for_dispatched_work()  # what the block dispatched runs in the trace
            finally:  # the trace stops even if waiting failed
                jax.profiler.stop_trace()
            paths = glob.glob(os.path.join(self._directory, "**", "*.xplane.pb"),
                              recursive=True)
            data = jax.profiler.ProfileData.from_file(paths[0]) if paths else None
        except BaseException:
            shutil.rmtree(self._directory, ignore_errors=True)
            raise
        finally:
            _ACTIVE.release()
        try:
            if data is None:
                self.function_events = EventList()
            else:
                self.function_events, self.device_name = trace.read_events(
                    data, self.options, _HOST_LABELS, _SCOPE_LABELS, _gpu_kind(),
                    hidden_modules={_BARRIER_MODULE})
        finally:
            shutil.rmtree(self._directory, ignore_errors=True)

    def _finished(self) -> EventList:
        if self.function_events is None:
            raise RuntimeError("The profile has not run yet: use it as `with profile() as "
                               "prof:` and read it after the block.")
        return self.function_events

    def events(self) -> EventList:
        """Every recorded event, in start order."""
        return self._finished()

    def key_averages(self, group_by_input_shape: bool = False,
                     group_by_stack_n: int = 0) -> EventList:
        """The events averaged by key (see `EventList.key_averages`)."""
        return self._finished().key_averages(group_by_input_shape, group_by_stack_n)

    def table(self, sort_by: str | None = None, row_limit: int = 100, **kwargs) -> str:
        """The events' table, one row per event (torch's `prof.table`); use
        `prof.key_averages().table(...)` for one row per key."""
        return self._finished().table(sort_by=sort_by, row_limit=row_limit, **kwargs)

    def total_average(self) -> FunctionEventAvg:
        return self._finished().total_average()

    @property
    def self_cpu_time_total(self) -> float:
        return self._finished().self_cpu_time_total

    def export_chrome_trace(self, path) -> None:
        """Writes the events as Chrome trace-event JSON, openable in Perfetto."""
        self._finished().export_chrome_trace(path)

    def export_stacks(self, path, metric: str = "self_cpu_time_total") -> None:
        """Writes the events' stacks for flame graph tools (needs `with_stack=True`)."""
        self._finished().export_stacks(path, metric)

    def __str__(self) -> str:
        return self.key_averages().table()


def _gpu_kind() -> str:
    """torch's name for this machine's GPUs: "rocm" on AMD, "cuda" otherwise."""
    try:
        version = jax.devices()[0].client.platform_version.lower()
    except Exception:  # no client version to read
        return "cuda"
    return "rocm" if "rocm" in version or "hip" in version else "cuda"


class _LabelledRange(contextlib.ContextDecorator):
    """A labelled range that works wherever it is used: around code that runs (eager code,
    eager `jax.grad`) it is a trace annotation (`jax.profiler.TraceAnnotation`); in code being
    staged into a program (inside `jax.jit`) it is a `jax.named_scope`, so every op it
    encloses carries the label into the compiled program and the trace. A profile shows both
    kinds as rows named by the label. `args` goes with the annotation into JAX's trace."""

    def __init__(self, name: str, args: str | None = None):
        if not isinstance(name, str) or not name:
            raise TypeError(f"name must be a non-empty str, got name={name!r}")
        if args is not None and not isinstance(args, str):
            raise TypeError(f"args must be a str or None, got args={args!r}")
        self.name = name
        self.args = args
        self._contexts: list = []

    def __enter__(self):
        if jx.staging():
            _SCOPE_LABELS.add(self.name)
            context = jax.named_scope(self.name)
        else:
            _HOST_LABELS.add(self.name)
            extra = {} if self.args is None else {"args": self.args}
            context = jax.profiler.TraceAnnotation(self.name, **extra)
        context.__enter__()
        self._contexts.append(context)
        return self

    def __exit__(self, *exc_info):
        return self._contexts.pop().__exit__(*exc_info)


class record_function(_LabelledRange):
    """A user-labelled range, a row of its own in `key_averages()` (torch's
    `record_function`); a context manager or a decorator, inside or outside `jax.jit`.
    The row is keyed by `name` alone, as torch's; `args` (a str) is recorded with the range
    in JAX's own trace (TensorBoard, Perfetto), outside `jax.jit`.

    Example:
      >>> import jax.numpy as jnp
      >>> from jamp.profile import profile, record_function
      >>> with profile() as prof:
      ...     with record_function("load"):
      ...         x = jnp.ones((4, 4)).block_until_ready()
      >>> [e.count for e in prof.key_averages() if e.key == "load"]
      [1]
    """

    def __init__(self, name: str, args: str | None = None):
        super().__init__(name, args)


class _EmitRanges(contextlib.ContextDecorator):
    """Shared by `emit_nvtx` and `emit_itt`: ranges named by the decorated function (with its
    arguments' shapes when `record_shapes`), or by `name` around a block."""

    _tool = ""

    def __init__(self, enabled: bool = True, record_shapes: bool = False, *,
                 name: str | None = None):
        _checks.check_bool("enabled", enabled)
        _checks.check_bool("record_shapes", record_shapes)
        if name is not None and (not isinstance(name, str) or not name):
            raise TypeError(f"name must be a non-empty str or None, got name={name!r}")
        self.enabled = enabled
        self.record_shapes = record_shapes
        self.name = name or self._tool
        self._ranges: list = []

    def __enter__(self):
        label = _LabelledRange(self.name)
        if self.enabled:
            label.__enter__()
        self._ranges.append(label if self.enabled else None)
        return self

    def __exit__(self, *exc_info):
        label = self._ranges.pop()
        return label.__exit__(*exc_info) if label is not None else None

    def __call__(self, fn: _F) -> _F:
        if not callable(fn):
            raise TypeError(f"{type(self).__name__} decorates a function, got {fn!r}")

        @functools.wraps(fn)
        def wrapped(*args, **kwargs):
            if not self.enabled:
                return fn(*args, **kwargs)
            label = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", self._tool)
            if self.record_shapes:
                label = f"{label}, sizes = {_sizes(args)}"
            with _LabelledRange(label):
                return fn(*args, **kwargs)
        return cast(_F, wrapped)


def _sizes(args) -> str:
    """torch's `sizes = [[2, 3], []]`: each positional argument's shape; [] for non-arrays
    (and for objects whose `shape` is not a tuple of sizes)."""
    def size(value) -> list:
        shape = getattr(value, "shape", None)
        return list(shape) if isinstance(shape, tuple) else []
    return str([size(a) for a in args])


class emit_nvtx(_EmitRanges):
    """Ranges for NVIDIA's tools (torch's `emit_nvtx`): a decorated function's calls (named by
    the function, with `sizes = [...]` of its arguments when `record_shapes`) or a block
    (named `name`, default "emit_nvtx"), as JAX trace annotations outside `jax.jit` and named
    scopes inside it. XLA's GPU runtime already labels each kernel with its HLO op; these
    ranges add yours. See docs/profile.md for what Nsight Systems shows."""

    _tool = "emit_nvtx"


class emit_itt(_EmitRanges):
    """Ranges for Intel's VTune (torch's `emit_itt`), as `emit_nvtx` makes them."""

    _tool = "emit_itt"


__all__ = ["emit_itt", "emit_nvtx", "profile", "record_function"]
