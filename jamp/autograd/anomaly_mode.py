"""Anomaly detection: torch's `detect_anomaly` / `set_detect_anomaly` for JAX.

A checked function is traced to a jaxpr and evaluated equation by equation; after each
equation, each floating output is tested for NaN (and, with `check_inf`, infinity) on the
device. Its backward is checked the same way: the function becomes one `jax.custom_vjp` whose
fwd runs `jax.vjp` of the checked forward and whose bwd traces the resulting pullback to a jaxpr
and evaluates that with checks. JAX gives every equation of a pullback the source info of the
forward equation it differentiates, so an anomaly in the backward is reported at the user's
forward line, with the forward primitive whose gradient it is.

The tests of one evaluation (`jamp.walker.nonfinite`'s codes) are gathered into one vector and
handed to one `jax.debug.callback`, which raises `AnomalyError` for the first anomaly in
evaluation order (evaluation order is a topological order, so that is where the value first
went bad). Eagerly the callback runs at once and the `AnomalyError` reaches the caller; in a
compiled program (`jax.jit`) JAX raises it from the running program as a
`jax.errors.JaxRuntimeError` (also a `RuntimeError`) whose message ends with the `AnomalyError`
text.

The evaluation is `jamp.walker`'s. Calls (`jax.jit`, `closed_call`) and `jax.checkpoint`
bodies are evaluated inline, so their equations are checked one by one (a checkpoint is not
rematerialized while checked). A `lax.scan` (also `fori_loop`, and the scans of a scan's
backward), a `while_loop` and a `cond`/`switch` are rebuilt around their bodies evaluated with
checks; the bodies' codes come out of the loop (those of the first iteration that made a bad
value) and out of the branch taken. Other higher-order primitives (custom_jvp / custom_vjp
functions, shard_map) run as they are and are checked at their outputs, reported at the user's
line that called them. A custom_vjp's bwd (a `jamp.autograd.Function`'s backward) that raises
gets the traceback of the forward call that created it added to its error, also with
`check_nan=False` (torch's other anomaly-mode service).

Values the function closes over that an enclosing transform differentiates become inputs of
the custom_vjp (`jax.closure_convert`), so their gradients flow as before.

The anomaly mode (`set_detect_anomaly`, `with detect_anomaly():`) is a JAX configuration
option in `jax.jit`'s cache key, read when a function wrapped in `anomaly_checked` is traced.
It also turns on JAX's own checks, `jax_debug_nans` (and `jax_debug_infs` for `check_inf`), for
everything else that runs while it is on: JAX tests the outputs of every operation run eagerly
and of every compiled call, and when a compiled call returns a NaN it runs the call again op by
op and raises at the primitive that made it. While the mode is on, that error is a
`FloatingPointAnomalyError` from the moment JAX raises it (torch's anomaly errors are
`RuntimeError`s, and torch users catch them inside the block): JAX's modules are made to raise
that type in place of `FloatingPointError` (`jx.raise_value_checks_as`; JAX has no hook). For a
backward pass under `jax.jit` that error names the primitive only; a `with` block keeps JAX's
frames in the error's traceback while it is on, and on leaving adds the traceback of the
forward call (the source info of the equation JAX was evaluating) as a note, then filters the
traceback as JAX would have. Functions marked `anomaly_checked` are evaluated with JAX's
checks off: jamp's own checks, with their richer report, see every value there first.

Forward mode: JAX refuses `jax.jvp` through a `jax.custom_vjp`, so where forward-mode
differentiation acts on the inputs (`jax.jvp`, `jax.jacfwd`, `jax.hessian`) the function is
checked without the custom_vjp: primal values are checked, tangents and any reverse pass are
not.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import linecache
import threading
import warnings
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jamp import _jax_internals as jx
from jamp._checks import check_bool
from jamp.policy.dtypes import is_inexact
from jamp.walker import control_flow, nonfinite
from jamp.walker.evaluate import Env, Interpreter

__all__ = ["AnomalyError", "Checks", "FloatingPointAnomalyError", "anomaly_checked",
           "detect_anomaly", "is_anomaly_check_nan_enabled", "is_anomaly_enabled",
           "set_detect_anomaly"]

_TRACEBACK_TITLE = "Traceback of forward call that caused the error:"


class AnomalyError(RuntimeError):
    """A NaN (or, with `check_inf`, an infinity) produced inside a function checked by anomaly
    detection. The message names the primitive, the pass (forward or backward) and the user's
    forward line that caused it."""


class FloatingPointAnomalyError(AnomalyError, FloatingPointError):
    """The error JAX's checks (`jax_debug_nans` / `jax_debug_infs`) raise while anomaly mode is
    on: JAX's message, and a `RuntimeError` as torch's anomaly error is, so `except
    RuntimeError`, `except AnomalyError` and `except FloatingPointError` all catch it, inside
    the block as outside. Leaving a `with` block it gets the user's forward line in a note."""


@dataclasses.dataclass(frozen=True)
class Checks:
    """What anomaly detection tests each floating value for."""

    nan: bool = True
    inf: bool = False

    @property
    def values(self) -> bool:
        return self.nan or self.inf


# -- the mode ---------------------------------------------------------------------------------

# "off", or "on" followed by what is checked: the value of one JAX config option, so that
# `jax.jit` keys its cache on it (a checked program is a different program).
_MODES = ("off", "on", "on:nan", "on:inf", "on:nan,inf")
_MODE = jx.jit_keyed_enum_state(
    "jamp_detect_anomaly", _MODES, "off",
    "jamp's anomaly mode (set it with jamp.autograd.set_detect_anomaly): whether functions "
    "wrapped in jamp.autograd.anomaly_checked are checked for NaN/inf when traced.")


def _mode_value(mode: bool, checks: Checks) -> str:
    if not mode:
        return "off"
    kinds = [k for k, on in (("nan", checks.nan), ("inf", checks.inf)) if on]
    return "on:" + ",".join(kinds) if kinds else "on"


class _JaxErrorType:
    """Which type JAX's checks raise: `FloatingPointAnomalyError` while anomaly mode is on in
    some thread (a `with` block of either form is open, or the mode is set for the process),
    JAX's own `FloatingPointError` otherwise. JAX's checks are one setting per thread but the
    type they raise is one per process (`jx.raise_value_checks_as`), so while one thread is in
    anomaly mode, another thread's own `jax_debug_nans` raises the anomaly type too (still a
    `FloatingPointError`)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._open_blocks = 0

    def update(self, opened: int = 0) -> None:
        """Follows the mode after it changed: `opened` blocks entered (or, negative, left)."""
        with self._lock:
            self._open_blocks += opened
            on = self._open_blocks > 0 or _MODE.get_global() != "off"
            jx.raise_value_checks_as(FloatingPointAnomalyError if on else None)


_JAX_ERROR_TYPE = _JaxErrorType()


def _mode_checks() -> Checks | None:
    value = _MODE.value
    if value == "off":
        return None
    kinds = value.partition(":")[2].split(",")
    return Checks(nan="nan" in kinds, inf="inf" in kinds)


def is_anomaly_enabled() -> bool:
    """True while anomaly mode is on (torch's `torch.is_anomaly_enabled`)."""
    return _mode_checks() is not None


def is_anomaly_check_nan_enabled() -> bool:
    """True while anomaly mode is on and checks for NaN (torch's
    `torch.is_anomaly_check_nan_enabled`)."""
    checks = _mode_checks()
    return checks is not None and checks.nan


class detect_anomaly:
    """Anomaly detection for a function: torch's `torch.autograd.detect_anomaly`.

    As a decorator, `detect_anomaly()(fn)` returns `fn` checked every time it runs or is
    traced: a NaN (with `check_nan`, the default) or an infinity (with `check_inf`) produced by
    any equation of its forward or of its backward raises `AnomalyError`, naming the primitive,
    the pass, and the user's forward line ("Traceback of forward call that caused the error").
    Under `jax.jit` the error reaches the caller as a `jax.errors.JaxRuntimeError` that carries
    the same message. With both checks off, only errors raised by a custom backward rule are
    given the traceback of the forward call that created it.

    As a context manager, `with detect_anomaly():` turns anomaly mode on for the block of this
    thread, torch's way: everything run inside is checked, marked or not. JAX's own checks
    (`jax_debug_nans`, and `jax_debug_infs` with `check_inf`) test the outputs of every
    operation and of every compiled call, and raise `FloatingPointAnomalyError` (a
    `RuntimeError` as torch's error is, and a `FloatingPointError` as JAX's is) at the primitive
    that made a NaN, forward or backward, also under `jax.jit(jax.grad(f))`; leaving the block,
    that error gets a note "Traceback of forward call that caused the error" naming the user's
    line (for a backward NaN, the forward line whose gradient made it). Functions wrapped in
    `anomaly_checked` are checked by jamp instead, with the report described above. The
    previous settings return when the block ends, also on an error. Under `jax.jit` only a
    compiled call's outputs are tested: a NaN that does not reach them (a forward value whose
    gradient is finite, under `jax.jit(jax.grad(f))`) passes, as it does in torch.

    torch checks for NaN in the backward only; jamp checks the forward too, and the arguments
    of the function and the gradient flowing into its backward, so an anomaly that comes from
    outside is reported as such. `check_inf` is jamp's: torch never checks for infinities.

    Args:
      check_nan: raise on NaN (torch's flag).
      check_inf: raise on an infinity too.

    Example:
      >>> import warnings
      >>> import jax, jax.numpy as jnp
      >>> from jamp.autograd.anomaly_mode import detect_anomaly
      >>> def loss(x):
      ...     return jnp.sqrt(x).sum()
      >>> with warnings.catch_warnings():
      ...     warnings.simplefilter("ignore")
      ...     checked = detect_anomaly()(loss)
      >>> jax.grad(checked)(jnp.array([0.0, 4.0]))
      Array([ inf, 0.25], dtype=float32)
      >>> jax.grad(checked)(jnp.array([-1.0, 4.0]))
      Traceback (most recent call last):
      ...
      jamp.autograd.anomaly_mode.AnomalyError: 'sqrt' returned nan in its output 0 in the ...
      ...
    """

    def __init__(self, check_nan: bool = True, *, check_inf: bool = False):
        self.checks = Checks(check_bool("check_nan", check_nan),
                             check_bool("check_inf", check_inf))
        self._previous: list = []
        warnings.warn("jamp anomaly detection is on: each checked equation tests its outputs, "
                      "which slows the program down; use it to debug.", stacklevel=2)

    def __call__(self, fn: Callable) -> Callable:
        return _checked(fn, self.checks)

    def __enter__(self) -> None:
        block = contextlib.ExitStack()
        block.enter_context(_MODE(_mode_value(True, self.checks)))
        block.enter_context(_jax_checks(self.checks))
        self._previous.append(block)
        _JAX_ERROR_TYPE.update(opened=1)

    def __exit__(self, exc_type, error, tb) -> None:
        self._previous.pop().close()
        _JAX_ERROR_TYPE.update(opened=-1)
        if error is not None:
            _name_the_source(error)


class set_detect_anomaly:
    """Turns anomaly mode on or off: torch's `torch.autograd.set_detect_anomaly`.

    Called as a statement, it sets the mode for the process, or, inside a `with
    detect_anomaly():` block of this thread, for the rest of that block; a block (of either)
    restores the mode it found when it ends, as torch's do. Functions wrapped in
    `anomaly_checked` are checked by jamp while it is on, and JAX's `jax_debug_nans` /
    `jax_debug_infs` are set to `mode and check_nan` / `mode and check_inf` for everything
    else (see `detect_anomaly`). As a context manager, it restores
    the previous settings on exit and, like `with detect_anomaly():`, adds the forward line to
    JAX's error; as a statement there is no moment to add it (under `jax.jit(jax.grad(f))`, a
    backward NaN is named by its primitive only). In both forms the error is a
    `FloatingPointAnomalyError`, a `RuntimeError` as torch's is. The mode is read
    when a marked function is traced, and `jax.jit` keys its cache on it: a jitted function
    called after the mode changed is traced again (once per mode), so turning the mode off
    returns to the unchecked program, compiled as before. JAX's checks are not in the cache
    key: turning them on recompiles nothing.

    Args:
      mode: anomaly mode on (True) or off (False).
      check_nan: raise on NaN (torch's flag).
      check_inf: raise on an infinity too (jamp's).
    """

    def __init__(self, mode: bool, check_nan: bool = True, *, check_inf: bool = False):
        checks = Checks(check_bool("check_nan", check_nan), check_bool("check_inf", check_inf))
        mode = check_bool("mode", mode)
        self.checks = checks if mode else Checks(nan=False, inf=False)
        self._block = contextlib.ExitStack()
        self._previous: tuple | None = None
        if jx.set_in_this_thread(_MODE):
            # This thread reads its block's settings, so the call sets those; left open as a
            # statement, they last until the enclosing block restores the ones it found (JAX's
            # option contexts, not a generator's, which would end when it is collected).
            self._block.enter_context(_MODE(_mode_value(mode, checks)))
            self._block.enter_context(jax.debug_nans(self.checks.nan))
            self._block.enter_context(jax.debug_infs(self.checks.inf))
            return
        self._previous = (_MODE.get_global(), *jx.value_checks_global())
        jax.config.update(_MODE.name, _mode_value(mode, checks))
        jax.config.update("jax_debug_nans", self.checks.nan)
        jax.config.update("jax_debug_infs", self.checks.inf)
        _JAX_ERROR_TYPE.update()

    def __enter__(self) -> None:
        # The settings are in effect from the call on; a block also names the source.
        if self.checks.values:
            self._block.enter_context(jx.unfiltered_tracebacks())
        _JAX_ERROR_TYPE.update(opened=1)

    def __exit__(self, exc_type, error, tb) -> None:
        self._block.close()
        if self._previous is not None:
            mode, nan, inf = self._previous
            jax.config.update(_MODE.name, mode)
            jax.config.update("jax_debug_nans", nan)
            jax.config.update("jax_debug_infs", inf)
        _JAX_ERROR_TYPE.update(opened=-1)
        if error is not None:
            _name_the_source(error)


@contextlib.contextmanager
def _jax_checks(checks: Checks):
    """JAX's own checks of every operation for this thread (`jax_debug_nans`, and
    `jax_debug_infs` for `check_inf`), with JAX's frames kept in the tracebacks of its errors
    while they are on, for `_name_the_source`."""
    with jax.debug_nans(checks.nan), jax.debug_infs(checks.inf), (
            jx.unfiltered_tracebacks() if checks.values else contextlib.nullcontext()):
        yield


def _without_jax_checks():
    return _jax_checks(Checks(nan=False, inf=False))


def _name_the_source(error: BaseException) -> None:
    """Leaving an anomaly block: JAX's `FloatingPointError` gets a note with the traceback of
    the user's code that made the value (for a backward pass, the forward line: JAX's own
    error from `jax.jit(jax.grad(f))` names only the primitive); then the error's traceback
    loses JAX's frames as it would have without the block."""
    if (isinstance(error, FloatingPointAnomalyError)
            and not getattr(error, "_jamp_anomaly_noted", False)):
        frames = jx.error_source(error.__traceback__)
        if frames:
            _add_note(error, _format_frames(frames))
    jx.filter_traceback(error)


def _add_note(error: BaseException, note: str) -> None:
    # Python 3.11's add_note; on 3.10 the note is kept, not printed.
    error.__notes__ = [*getattr(error, "__notes__", []), note]
    error._jamp_anomaly_noted = True  # type: ignore[attr-defined]  # a mark, on purpose


def anomaly_checked(fn: Callable) -> Callable:
    """`fn`, checked by anomaly detection whenever it is traced while anomaly mode is on
    (`set_detect_anomaly(True)`, or inside `with detect_anomaly():`); while the mode is off it
    calls `fn` directly, so its traced program is `fn`'s own (no cost). torch's workflow: mark
    the loss once, switch the mode from the outside.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jamp.autograd.anomaly_mode import anomaly_checked, set_detect_anomaly
      >>> loss = anomaly_checked(lambda x: jnp.log(x).sum())
      >>> float(loss(jnp.array([-1.0])))  # the mode is off: no check
      nan
      >>> with set_detect_anomaly(True):
      ...     loss(jnp.array([-1.0]))
      Traceback (most recent call last):
      ...
      jamp.autograd.anomaly_mode.AnomalyError: 'log' returned nan in its output 0 in the forward ...
      ...
    """

    @functools.wraps(fn)
    def gated(*args, **kwargs):
        checks = _mode_checks()
        if checks is None:
            return fn(*args, **kwargs)
        return _run(fn, checks, args, kwargs)

    return gated


def _checked(fn: Callable, checks: Checks) -> Callable:
    @functools.wraps(fn)
    def checked(*args, **kwargs):
        return _run(fn, checks, args, kwargs)

    return checked


# -- running a checked function ---------------------------------------------------------------

def _is_array(x) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic))


def _run(fn: Callable, checks: Checks, args: tuple, kwargs: dict) -> Any:
    """Traces `fn` on the array leaves of its arguments (other leaves are static) and evaluates
    it with checks."""
    with_paths, tree = jax.tree_util.tree_flatten_with_path((args, kwargs))
    leaves = [leaf for _, leaf in with_paths]
    where = [i for i, leaf in enumerate(leaves) if _is_array(leaf)]
    names = [_argument_name(with_paths[i][0]) for i in where]
    out_tree: list = []

    def flat_fn(*arrays):
        full = list(leaves)
        for i, a in zip(where, arrays, strict=True):
            full[i] = a
        a, k = jax.tree_util.tree_unflatten(tree, full)
        out_leaves, structure = jax.tree_util.tree_flatten(fn(*a, **k))
        out_tree[:] = [structure]
        return out_leaves

    arrays = [leaves[i] for i in where]
    # Values `fn` closes over that an enclosing transform differentiates (a model's
    # parameters under `jax.grad`) become inputs: a custom_vjp may not close over them.
    converted, hoisted = jax.closure_convert(flat_fn, *arrays)
    inputs = arrays + list(hoisted)
    names += [f"closed-over value {i}" for i in range(len(hoisted))]
    closed = jx.trace_closed(converted, [jax.typeof(a) for a in inputs])
    program = _Program(closed, checks, getattr(fn, "__name__", type(fn).__name__), names)
    outs = program(inputs)
    return jax.tree_util.tree_unflatten(out_tree[0], outs)


def _argument_name(path) -> str:
    # The path into `(args, kwargs)`: `argument args[0]['w']`, `argument kwargs['x']`.
    head, rest = path[0], path[1:]
    base = "args" if getattr(head, "idx", None) == 0 else "kwargs"
    return "argument " + base + jax.tree_util.keystr(tuple(rest))


@dataclasses.dataclass
class _Program:
    """One traced function and what its checks report against."""

    closed: jx.ClosedJaxpr
    checks: Checks
    name: str
    arg_names: Sequence[str]

    def __call__(self, arrays: list) -> list:
        # jamp checks each equation here itself, with the richer report: JAX's own checks
        # (on in an anomaly block) would stop an eager evaluation at the first bad value first.
        with _without_jax_checks():
            if not self.checks.values:
                return _Evaluation(self, backward=False).run_checked(self.closed, arrays,
                                                                   check=False)
            if any("forward" in jx.autodiff_kinds(a) for a in arrays):
                return self._forward(arrays)
            return self._with_checked_backward(arrays)

    def _forward(self, arrays: list) -> list:
        evaluation = _Evaluation(self, backward=False)
        outs = evaluation.run_checked(self.closed, arrays)
        evaluation.report()
        return outs

    def _with_checked_backward(self, arrays: list) -> list:
        out_avals = self.closed.out_avals
        # The forward's sites (Python objects, not residuals) for the bwd's report: this
        # custom_vjp is made for one call, so its fwd runs before its bwd.
        forward_box: list = []

        @jax.custom_vjp
        def checked(*xs):
            return self._forward(list(xs))

        def fwd(*xs):
            evaluation = _Evaluation(self, backward=False)

            def forward(*ys):
                outs = evaluation.run_checked(self.closed, list(ys))
                return outs, evaluation.codes()

            outs, pullback, codes = jax.vjp(forward, *xs, has_aux=True)
            evaluation.report(codes)
            forward_box[:] = [evaluation]
            return outs, (pullback, codes)

        def bwd(residual, cts):
            pullback, forward_codes = residual
            with _without_jax_checks():
                return tuple(self._backward(pullback, forward_codes, forward_box[0], cts,
                                            out_avals))

        checked.defvjp(fwd, bwd)
        return list(checked(*arrays))

    def _backward(self, pullback, forward_codes, forward: "_Evaluation", cts, out_avals):
        # The pullback is a pytree whose leaves are the residuals: traced to a jaxpr of
        # (residuals, floating cotangents), it is evaluated like the forward. Cotangents of
        # integer outputs are float0 zeros, made inside.
        res, res_tree = jax.tree_util.tree_flatten(pullback)
        floating = [i for i, a in enumerate(out_avals) if is_inexact(a)]

        def backward(res, given):
            full = [np.zeros(a.shape, jax.dtypes.float0) for a in out_avals]
            for i, c in zip(floating, given, strict=True):
                full[i] = c
            return jax.tree_util.tree_unflatten(res_tree, res)(full)

        given = [cts[i] for i in floating]
        closed = jx.trace_closed(lambda *a: backward(list(a[:len(res)]), list(a[len(res):])),
                                 [jax.typeof(a) for a in res + given])
        evaluation = _Evaluation(self, backward=True, forward=forward,
                                 checked_inputs=range(len(res), len(res) + len(given)),
                                 input_outputs=floating)
        outs = evaluation.run_checked(closed, res + given)
        evaluation.report(evaluation.codes(), forward_codes)
        return outs


@dataclasses.dataclass(frozen=True)
class _Site:
    """Where a checked value comes from: an equation's output, or an input of the jaxpr."""

    primitive: str | None        # None for an input
    output: int
    frames: tuple                # the user's frames, outermost first
    source: int | None = None    # jx.source_key of the equation
    input_name: str = ""


@dataclasses.dataclass
class _Frame(Env):
    """The env of one evaluated body: the position of the equation it belongs to (the indices
    of the equations around it, a cond's branch), and the user's frames of the call whose
    body it is (JAX records a body's stack from the body inwards)."""

    key: tuple = ()
    caller: tuple = ()


class _Evaluation(Interpreter[_Frame]):
    """One evaluation of a jaxpr with checks: each floating result's code
    (`jamp.walker.nonfinite`) and where it comes from. Calls are inlined; loops and branches
    are rebuilt around their bodies evaluated with checks, the bodies' codes carried out as
    side results (a loop's from its first iteration that made a bad value); other higher-order
    primitives are checked at their outputs."""

    def __init__(self, program: _Program, backward: bool, forward: "_Evaluation | None" = None,
                 checked_inputs: Sequence[int] | None = None,
                 input_outputs: Sequence[int] = ()):
        self.program = program
        self.checks = program.checks
        self.backward = backward
        self.forward = forward
        self.checked_inputs = checked_inputs
        self.input_outputs = list(input_outputs)
        self.check = True
        # Every site met, by key, in evaluation order (a body traced twice meets its sites
        # again under the same keys).
        self.sites: dict[tuple, _Site] = {}
        self._codes: dict = {}
        self.primitives: dict[int, str] = {}  # forward: source key -> primitive name

    # -- evaluation

    def new_env(self, closed: jx.ClosedJaxpr) -> _Frame:
        return _Frame()

    def run_checked(self, closed: jx.ClosedJaxpr, args: list, check: bool = True) -> list:
        """`closed`'s outputs on `args`, its inputs (or `checked_inputs`) and every floating
        result of its equations checked (with `check`)."""
        self.check = check
        top = _Frame()
        inputs = range(len(args)) if self.checked_inputs is None else self.checked_inputs
        for k, i in enumerate(inputs):
            self._test(top, (-1, k), args[i],
                       _Site(None, k, (), input_name=self._input_name(k)))
        outs, self._codes = self.run(closed, args, top)
        return outs

    def _input_name(self, k: int) -> str:
        if self.backward:
            return f"the gradient of output {self.input_outputs[k]}"
        return self.program.arg_names[k]

    def default(self, env: _Frame, eqn, invals: list) -> list:
        params = eqn.params
        if eqn.primitive.name == "custom_vjp_call":
            params = _with_noted_bwd(eqn, _frames(eqn, env.caller))
        outs = jx.bind(eqn, params, invals)
        self._note(env, eqn, outs)
        return outs

    def _inner(self, env: _Frame, eqn, branch: tuple = ()) -> Callable:
        """The body evaluator of `eqn`'s bodies (of its branch `branch`)."""
        key = (*env.key, env.index, *branch)
        caller = _frames(eqn, env.caller)
        return self.body(lambda closed: _Frame(key=key, caller=caller))

    def _call(self, env: _Frame, eqn, invals: list) -> list:
        outs, codes = control_flow.call(eqn, invals, self._inner(env, eqn))
        env.extras.update(codes)
        return outs

    def _scan(self, env: _Frame, eqn, invals: list) -> list:
        if not self.check:
            return self.default(env, eqn, invals)
        outs, codes = control_flow.scan(eqn, invals, self._inner(env, eqn))
        reverse = jx.scan_parts(eqn.params)[3]["reverse"]
        env.extras.update(nonfinite.first_iteration(codes, reverse))
        return outs

    def _while(self, env: _Frame, eqn, invals: list) -> list:
        if not self.check:
            return self.default(env, eqn, invals)
        outs, codes = control_flow.while_loop(
            eqn, invals, self._inner(env, eqn),
            lambda closed, args: jx.eval_closed(closed, args)[0], combine=nonfinite.keep_first)
        env.extras.update(codes)
        return outs

    def _cond(self, env: _Frame, eqn, invals: list) -> list:
        if not self.check:
            return self.default(env, eqn, invals)
        bodies = [self._inner(env, eqn, (k,)) for k in range(len(eqn.params["branches"]))]
        outs, codes = control_flow.switch(eqn, invals[0], invals[1:], bodies)
        env.extras.update(codes)
        return outs

    # A custom_jvp keeps its rule (the program is differentiated): checked at its outputs.
    rules = {**dict.fromkeys(jx.CALLS - {"custom_jvp_call"}, _call),
             "scan": _scan, "while": _while, "cond": _cond}

    def _note(self, env: _Frame, eqn, outs: Sequence[Any]) -> None:
        name = _primitive_label(eqn)
        key = jx.source_key(eqn)
        if not self.backward:
            self.primitives.setdefault(key, name)
        if not self.check:
            return
        frames = None
        for k, value in enumerate(outs):
            if is_inexact(jax.typeof(value)):
                frames = frames if frames is not None else _frames(eqn, env.caller)
                self._test(env, (*env.key, env.index, k), value, _Site(name, k, frames, key))

    def _test(self, env: _Frame, key: tuple, value, site: _Site) -> None:
        if not self.check or not is_inexact(jax.typeof(value)) or not np.size(value):
            return
        self.sites[key] = site
        env.extras[key] = nonfinite.code(value, nan=self.checks.nan, inf=self.checks.inf)

    # -- reporting

    def codes(self) -> jax.Array:
        """One code per site, in the order of `sites`."""
        if not self.sites:
            return jnp.zeros((0,), nonfinite.CODE_DTYPE)
        return jnp.stack([self._codes[key] for key in self.sites])

    def report(self, codes=None, forward_codes=None) -> None:
        """Raises (through a debug callback, so also inside compiled programs) for the first
        anomaly: of the forward whose codes are `forward_codes`, if any, then of this one."""
        codes = self.codes() if codes is None else codes
        if forward_codes is None and not self.sites:
            return
        forward = self.forward

        def raise_first(codes, forward_codes):
            if forward_codes is not None:
                forward._raise_first(forward_codes)
            self._raise_first(codes)

        if jx.is_tracer(codes) or jx.is_tracer(forward_codes):
            jax.debug.callback(raise_first, codes, forward_codes)
        else:
            raise_first(codes, forward_codes)  # eagerly: at once, with no callback's log

    def _raise_first(self, codes) -> None:
        # Under vmap the callback gets one row of codes per example.
        codes = np.bitwise_or.reduce(np.asarray(codes).reshape(-1, len(self.sites)), axis=0) \
            if self.sites else ()
        for site, code in zip(self.sites.values(), codes):
            if code:
                kind = "nan" if code & nonfinite.NAN else "inf"
                raise AnomalyError(self._message(site, kind))

    def _message(self, site: _Site, kind: str) -> str:
        name = self.program.name
        if site.primitive is None:
            if self.backward:
                return (f"{site.input_name} of {name}, flowing into its backward pass, holds "
                        f"{kind}: it was produced outside {name}.")
            return (f"{site.input_name} of {name} holds {kind}: it was produced outside "
                    f"{name}.")
        text = f"'{site.primitive}' returned {kind} in its output {site.output} in the "
        if self.backward:
            text += f"backward pass of {name}"
            of = self.forward.primitives.get(site.source) \
                if self.forward and site.source is not None else None
            if of is not None:
                text += f" (part of the gradient of '{of}')"
        else:
            text += f"forward pass of {name}"
        return text + ".\n" + _format_frames(site.frames)


def _format_frames(frames: Sequence[tuple[str, int, str]]) -> str:
    """The traceback of a forward call, in Python's layout, jamp's own frames left out. JAX
    records an equation's Python stack from the traced function inwards (not its callers)."""
    lines = [_TRACEBACK_TITLE]
    for file, line, function in frames:
        if file.startswith(jx.JAMP_DIR):
            continue
        lines.append(f'  File "{file}", line {line}, in {function}')
        source = linecache.getline(file, line).strip()
        if source:
            lines.append(f"    {source}")
    if len(lines) == 1:
        lines.append("  (JAX recorded no Python frame of the user's code)")
    return "\n".join(lines)


def _frames(eqn, caller: tuple) -> tuple:
    own = jx.user_frames(eqn)
    return tuple(caller) + tuple(f for f in own if f not in caller)


def _primitive_label(eqn) -> str:
    name = eqn.primitive.name
    if name in ("custom_jvp_call", "custom_vjp_call"):
        wrapped = jx.custom_call_name(eqn.params)
        if wrapped:
            return f"{name} of {wrapped}"
    return name


def _with_noted_bwd(eqn, frames: tuple) -> dict:
    """custom_vjp_call params whose bwd, when it raises, adds the traceback of the forward
    call that created it (`frames`) to the error (torch's anomaly-mode note)."""

    def wrap_bwd(bwd: Callable) -> Callable:
        def noted(*args):
            try:
                return bwd(*args)
            except Exception as error:  # re-raised unchanged, with a note
                if not getattr(error, "_jamp_anomaly_noted", False):
                    _add_note(error, _format_frames(frames))
                raise

        return noted

    return jx.custom_vjp_params(eqn.params, jx.custom_call_body(eqn.params), lambda c: c,
                                wrap_bwd)
