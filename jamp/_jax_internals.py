"""Every touch of JAX internals that jamp needs, in one place: autocast's (`jamp.transforms`),
the autograd tools' (`jamp.autograd`: which differentiation acts on a `Function`, what depends
on what, anomaly checks, grad mode, dual levels), the profiler's (`jamp.profile`: name stacks,
live executables, the AMP report's tally) and the op tables' (`jamp.policy.primitives`). It
also holds the facts about JAX's primitives that follow its versions: which primitives are
calls (`CALLS`) and where an equation keeps its bodies (`bodies`), which the one walk over a
jaxpr's equations (`jamp.walker.walk`) reads.

It imports nothing of jamp, so every part of jamp may import it, `jamp.policy` included.

autocast evaluates a jaxpr equation by equation and re-binds higher-order primitives with
transformed sub-jaxprs. jax.extend.core gives the jaxpr types; the rest (equation name stacks,
the parameters of `custom_jvp_call` / `custom_vjp_call`, the linear-util wrappers their
derivative rules travel in) has no public API. Each helper says why it is needed. Supported:
jax 0.10.x, 0.11.x and 0.12.x.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import os
import types
from typing import Any, Callable, Iterable, Sequence, cast

import jax
from jax import lax
from jax.extend import core as jex_core

# jax.extend.core: the jaxpr data types the interpreter walks (public, but "extend" stability).
ClosedJaxpr = jex_core.ClosedJaxpr
Jaxpr = jex_core.Jaxpr
JaxprEqn = jex_core.JaxprEqn
Literal = jex_core.Literal
Var = jex_core.Var
# An array's aval (public in jax.core): what a Var's aval, typed as its abstract base, is here.
ShapedArray = jax.core.ShapedArray

# Needed for equation source info (name stacks carry autocast regions) and for re-wrapping the
# lazily traced derivative rules of custom_jvp/custom_vjp, which are `lu.WrappedFun`s.
from jax._src import linear_util as _lu  # noqa: E402
from jax._src import source_info_util as _source_info  # noqa: E402
# The settings that key jax.jit's own cache: autocast's cache of traced programs uses them too.
from jax._src import config as _config  # noqa: E402
# The tracer types of jvp, linearize and vmap: which differentiation acts on a Function's inputs.
from jax._src.interpreters import ad as _ad  # noqa: E402
from jax._src.interpreters import batching as _batching  # noqa: E402
# JAX's filter of its own frames out of tracebacks: anomaly mode turns it off for a block to
# find the equation that made a NaN, then filters the error's traceback as JAX would have.
from jax._src import traceback_util as _traceback_util  # noqa: E402


def is_tracer(x) -> bool:
    """True for a value being traced (not a concrete array)."""
    return isinstance(x, jax.core.Tracer)


def weak_aval(x) -> Any:
    """The abstract value of `x`, weak-typed (as a Python scalar's would be)."""
    return jax.typeof(x).update(weak_type=True)


def trace_closed(fn: Callable, avals: Sequence[Any]) -> ClosedJaxpr:
    """Traces `fn(*args)` at abstract values to a closed jaxpr (public `jax.make_jaxpr`).

    The avals' shardings and, inside `shard_map`, their varying manual axes are kept: both are
    part of the type (a replicated operand meeting a varying one is an error otherwise).
    """
    return jax.make_jaxpr(fn)(*map(_spec, avals))


def eval_closed(closed: ClosedJaxpr, args: Sequence[Any]) -> list[Any]:
    """Evaluates a closed jaxpr on `args`, binding on the current trace."""
    return jax.core.eval_jaxpr(closed.jaxpr, closed.consts, *args)


def _spec(aval) -> jax.ShapeDtypeStruct:
    weak_type = getattr(aval, "weak_type", False)
    # Varying manual axes (`manual_axis_type`, jax 0.10 and 0.11) are always kept: dropping
    # them would make a replicated operand meet a varying one inside shard_map.
    manual = dict(manual_axis_type=aval.manual_axis_type) if getattr(
        aval, "manual_axis_type", None) is not None else {}
    sharding = getattr(aval, "sharding", None)
    if sharding is not None:
        try:
            return jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=weak_type,
                                        sharding=sharding, **manual)
        except (TypeError, ValueError):
            pass  # a sharding ShapeDtypeStruct does not take (an abstract mesh's): not a type
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=weak_type, **manual)


def with_debug_info(flat_fn: Callable, fn: Callable, arg_names: Sequence[str],
                    traced_for: str = "jamp.autocast") -> Callable:
    """Marks `flat_fn` (which traces `fn` on flattened inputs) so that errors raised while
    tracing it name `fn`, its source line and the user's argument paths, as `jax.jit`'s do.
    jax reads the `__fun_debug_info__` attribute that its own wrappers set."""
    info = jex_core.DebugInfo(traced_for, _function_location(fn), tuple(arg_names), None)
    flat_fn.__fun_debug_info__ = info  # type: ignore[attr-defined]  # jax's mark, on purpose
    return flat_fn


def _function_location(fn: Callable) -> str:
    while isinstance(fn, functools.partial):
        fn = fn.func
    fn = inspect.unwrap(fn)
    code = getattr(getattr(fn, "__func__", fn), "__code__", None)
    if code is None:
        # The class's own __call__ (for its code), not a test of callability.
        code = getattr(getattr(type(fn), "__call__", None), "__code__", None)  # noqa: B004
    name = getattr(fn, "__name__", type(fn).__name__)
    if code is None:
        return name
    return f"{name} at {code.co_filename}:{code.co_firstlineno}"


def trace_context() -> Any:
    """The JAX settings a traced program depends on (x64, matmul precision, the mesh...), as
    `jax.jit` keys its cache with them."""
    return _config.trace_context()


def name_stack(eqn: JaxprEqn):
    """The equation's name stack: where `jax.named_scope` regions (and so autocast regions)
    are recorded. Not public: `source_info` is an internal field of `JaxprEqn`."""
    return eqn.source_info.name_stack


@contextlib.contextmanager
def equation_context(eqn: JaxprEqn):
    """Re-enters an equation's source info and context while re-binding it, as
    `jax.core.eval_jaxpr` does, so the output program keeps the user's scope names (Flax module
    paths, autocast regions) and tracebacks."""
    stack = _source_info.current_name_stack() + eqn.source_info.name_stack
    with _source_info.user_context(eqn.source_info.traceback, name_stack=stack):
        ctx = getattr(eqn, "ctx", None)
        with (ctx.manager if ctx is not None else contextlib.nullcontext()):
            yield


def bind(eqn: JaxprEqn, params: dict, invals: Sequence[Any]) -> list[Any]:
    """Binds `eqn.primitive` with `params` (which may differ from `eqn.params`) and returns a
    list of outputs. `get_bind_params` turns stored params into bind-time ones (adding the
    `subfuns` of primitives that carry functions: custom_jvp_call, custom_vjp_call); in every jax
    jamp supports it returns one dict (jax 0.9.0 and older returned `(subfuns, params)`).
    A scatter (see `retypeable_scatter`) whose operand changed dtype is bound through lax's
    function, which types its update computation for the new dtype."""
    prim = eqn.primitive
    if (prim.name in _SCATTER_FUNCTIONS
            and invals[0].dtype != cast(ShapedArray, eqn.invars[0].aval).dtype
            and retypeable_scatter(eqn)):
        operand, indices, updates = invals
        return [_SCATTER_FUNCTIONS[prim.name](
            operand, indices, updates, params["dimension_numbers"],
            indices_are_sorted=params["indices_are_sorted"],
            unique_indices=params["unique_indices"], mode=params["mode"])]
    out = prim.bind(*invals, **prim.get_bind_params(params))
    return list(out) if prim.multiple_results else [out]


# Scatters whose update computation is lax's own: none (`scatter` sets) or the one binary op
# of the same name.
_SCATTER_FUNCTIONS = {"scatter": lax.scatter, "scatter-add": lax.scatter_add,
                      "scatter-sub": lax.scatter_sub, "scatter-mul": lax.scatter_mul,
                      "scatter-min": lax.scatter_min, "scatter-max": lax.scatter_max}


def retypeable_scatter(eqn: JaxprEqn) -> bool:
    """A scatter that sets, adds, subtracts, multiplies or takes extremes, as `.at[]` and the
    gradients of gathers write them: lax re-types its update computation for other dtypes. A
    computation of the user's (`.at[].apply`) is typed for the traced dtypes."""
    name = eqn.primitive.name
    if name not in _SCATTER_FUNCTIONS:
        return False
    body = eqn.params.get("update_jaxpr")
    body = getattr(body, "jaxpr", body)
    if name == "scatter":
        return body is None
    op = name.removeprefix("scatter-")
    return (body is not None and not eqn.params.get("update_consts")
            and len(body.eqns) == 1 and body.eqns[0].primitive.name == op
            and list(body.eqns[0].invars) == list(body.invars)
            and list(body.eqns[0].outvars) == list(body.outvars))


# -- primitive params (their names are not a public API and change between versions) ---------

# Params that name an output dtype; when they equal the traced input dtype they only say "the
# result type", so they follow the dtype autocast chose.
_RESULT_DTYPE_PARAMS = ("preferred_element_type", "out_dtype")

def convert_target(eqn: JaxprEqn) -> tuple[Any, bool]:
    """The (new_dtype, weak_type) of a `convert_element_type` equation."""
    return eqn.params["new_dtype"], bool(eqn.params.get("weak_type", False))


def with_result_dtype(params: dict, traced_in, new_in) -> dict:
    """`params` with result-dtype params that only restated `traced_in` set to `new_in`."""
    if traced_in is None or new_in is None or traced_in == new_in:
        return params
    changes = {key: new_in for key in _RESULT_DTYPE_PARAMS
               if params.get(key) is not None and params[key] == traced_in}
    return dict(params, **changes) if changes else params


def with_accumulator_dtype(params: dict, dtype) -> dict:
    """A matmul's or convolution's `params` asking for its result in `dtype` (accumulated
    there, never rounded below it)."""
    return dict(params, **{key: dtype for key in _RESULT_DTYPE_PARAMS if key in params})


# -- calls and the bodies of higher-order equations ------------------------------------------

# Calls: one body (`call_body`) takes the equation's operands and returns its results, so
# binding the body in the equation's place computes the same values. A function call (`jit`,
# `closed_call`) is nothing more; `closed_call` is named `eval_jaxpr` from jax 0.11 (same
# `call_jaxpr` param, and the name it leaves in HLO op names): the running jax's name.
CLOSED_CALL = jex_core.primitives.closed_call_p.name
FUNCTION_CALLS = frozenset({"jit", CLOSED_CALL})
# With what a call may add around its body: a rematerialization policy (`remat2`) or a custom
# derivative rule (`custom_jvp_call`, whose rule is lost when its body is bound instead).
CALLS = FUNCTION_CALLS | {"remat2", "custom_jvp_call"}


def bodies(eqn: JaxprEqn) -> list[Jaxpr]:
    """The jaxprs in an equation's params, open, in the order of its params: a higher-order
    primitive's bodies (a call's body, a scan's, a while's condition and body, a cond's
    branches); empty for a first-order equation."""
    return [getattr(sub, "jaxpr", sub) for sub in jex_core.jaxprs_in_params(eqn.params)]


def call_body_key(params: dict) -> str:
    """The param holding the body of a `jit` (`jaxpr`) or `closed_call`/`eval_jaxpr`
    (`call_jaxpr`)."""
    return "jaxpr" if "jaxpr" in params else "call_jaxpr"


def jit_inlined_when_lowered(params: dict) -> bool:
    """True for a `jit` equation whose body lowering copies into its caller at each call
    (`jax.jit(..., inline=True)` from jax 0.11, which keeps such calls in the jaxpr); other jit
    bodies lower to one function however often they are called (older jax inlined these while
    tracing)."""
    late = getattr(getattr(jax, "Inline", None), "JAX_LATE", None)
    return late is not None and params.get("inline") is late


def custom_call_body(params: dict) -> ClosedJaxpr:
    """The primal body of a custom_jvp_call / custom_vjp_call equation."""
    return params["call_jaxpr"]


def call_body(eqn: JaxprEqn) -> ClosedJaxpr:
    """The body of a call (one of `CALLS`)."""
    name = eqn.primitive.name
    if name == "remat2":
        return remat_body(eqn.params)
    if name == "custom_jvp_call":
        return custom_call_body(eqn.params)
    return _as_closed(eqn.params[call_body_key(eqn.params)])


def custom_call_num_consts(params: dict) -> int:
    return params["num_consts"]


def _wrap(fn: Callable, like) -> Any:
    """A `lu.WrappedFun` of `fn` with the debug info of `like` (custom_jvp/custom_vjp params
    must be WrappedFuns)."""
    return _lu.wrap_init(fn, debug_info=like.debug_info)


def custom_jvp_params(
    params: dict, call_jaxpr: ClosedJaxpr,
    transform: Callable[[ClosedJaxpr, tuple, tuple], ClosedJaxpr],
) -> dict:
    """custom_jvp_call params with a new primal body and the user's jvp rule passed through
    `transform(jvp_jaxpr, zeros, out_zeros)`, traced lazily as JAX does when it
    differentiates. The jvp jaxpr takes the non-const primals, then the tangents that are not
    symbolic zeros (`zeros`), and returns the primal outputs, then the output tangents that are
    not zeros (`out_zeros`)."""
    jvp_fun = params["jvp_jaxpr_fun"]
    cache: dict = {}

    def jvp_jaxpr_fun(*zeros):
        if zeros not in cache:
            jaxpr, consts, out_zeros = jvp_fun.call_wrapped(*zeros)
            new = transform(ClosedJaxpr(jaxpr, consts), tuple(zeros), tuple(out_zeros))
            cache[zeros] = (new.jaxpr, new.consts, out_zeros)
        return cache[zeros]

    return dict(params, call_jaxpr=call_jaxpr, jvp_jaxpr_fun=_wrap(jvp_jaxpr_fun, jvp_fun))


def custom_vjp_params(params: dict, call_jaxpr: ClosedJaxpr,
                      transform: Callable[[ClosedJaxpr], ClosedJaxpr],
                      wrap_bwd: Callable[[Callable], Callable]) -> dict:
    """custom_vjp_call params with a new primal body, the user's fwd passed through
    `transform` (same interface) and the user's bwd wrapped by `wrap_bwd`."""
    thunk = params["fwd_jaxpr_thunk"]
    bwd = params["bwd"]
    cache: dict = {}

    def fwd_jaxpr_thunk(*zeros):
        if zeros not in cache:
            jaxpr, consts = thunk.call_wrapped(*zeros)
            new = transform(ClosedJaxpr(jaxpr, consts))
            cache[zeros] = (new.jaxpr, new.consts)
        return cache[zeros]

    new_bwd = wrap_bwd(bwd.call_wrapped)
    return dict(params, call_jaxpr=call_jaxpr,
                fwd_jaxpr_thunk=_wrap(fwd_jaxpr_thunk, thunk), bwd=_wrap(new_bwd, bwd))


def custom_vjp_bwd(params: dict) -> Callable:
    """The bwd a `custom_vjp_call` equation was made with, as its user passed it to
    `defvjp` (the callable inside the `lu.WrappedFun` JAX keeps in the params): autocast
    recognizes a `jamp.autograd.Function`'s call by it."""
    return params["bwd"].f


def tangent_aval(aval):
    """The aval of a tangent of `aval` (float0 for integer primals)."""
    return aval.to_tangent_aval()


def is_symbolic_zero(x) -> bool:
    """True for the `Zero`/`SymbolicZero` objects a custom_vjp bwd may return instead of an
    array (they cannot be traced into a jaxpr, so they are passed around it)."""
    return not hasattr(x, "dtype") or type(x).__name__ in ("Zero", "SymbolicZero")


_NO_LOGS = object()


def split_bwd_result(out) -> tuple[list, Any]:
    """A custom_vjp bwd's flat cotangents and its backward-pass logs: newer jax (after 0.11.0)
    returns `(cts, logs)` from the wrapped bwd, older jax the cotangents alone."""
    if (isinstance(out, tuple) and len(out) == 2 and isinstance(out[0], (list, tuple))
            and (out[1] is None or isinstance(out[1], dict))):
        return list(out[0]), out[1]
    return list(out), _NO_LOGS


def has_no_logs(logs) -> bool:
    return logs is _NO_LOGS


def join_bwd_result(cts: list, logs, original_logs):
    """Inverse of `split_bwd_result`."""
    return cts if original_logs is _NO_LOGS else (cts, logs)


def remat_options(params: dict) -> dict:
    """`jax.checkpoint` keywords that rebuild a `remat`/`checkpoint` equation."""
    return dict(prevent_cse=params.get("prevent_cse", True), policy=params.get("policy"))


def _as_closed(jaxpr) -> ClosedJaxpr:
    # jax 0.10 stores these bodies as open `Jaxpr`s; from 0.11 `ClosedJaxpr is Jaxpr` and a
    # body may carry its consts already.
    return jaxpr if isinstance(jaxpr, ClosedJaxpr) else ClosedJaxpr(jaxpr, ())


def remat_body(params: dict) -> ClosedJaxpr:
    """The body of a remat equation as a closed jaxpr."""
    return _as_closed(params["jaxpr"])


def shard_map_options(params: dict) -> dict:
    """`jax.shard_map` keywords that rebuild a shard_map equation (names differ by version)."""
    options = dict(mesh=params["mesh"], in_specs=tuple(params["in_specs"]),
                   out_specs=tuple(params["out_specs"]))
    for key in ("check_vma", "check_rep"):
        if key in params:
            options["check_vma"] = params[key]
    for key in ("newly_manual_axes", "manual_axes", "axis_names"):
        if key in params:
            options["axis_names"] = frozenset(params[key])
            break
    return options


def shard_map_body(params: dict) -> ClosedJaxpr:
    """The body of a shard_map equation as a closed jaxpr."""
    return _as_closed(params["jaxpr"])


def has_batch_dimensions(eqn: JaxprEqn) -> bool:
    """True for a `dot_general` with batch dimensions (a batched matmul, as attention's
    scores); convolutions have none."""
    numbers = eqn.params.get("dimension_numbers")
    if eqn.primitive.name != "dot_general" or numbers is None:
        return False
    (_, _), (lhs_batch, rhs_batch) = numbers
    return bool(len(lhs_batch) or len(rhs_batch))


_FULL_PRECISION_ALGORITHMS = ("F32_F32_F32", "F64_F64_F64")


def asks_full_precision(params: dict) -> bool:
    """True for a matmul or convolution written with `precision=lax.Precision.HIGHEST` (for
    either operand) or a float32/float64 dot algorithm: what `jnp.linalg`'s composites (`pinv`,
    `lstsq`, `solve`, `inv`) and `jax.scipy.linalg.expm` ask of their inner matmuls."""
    precision = params.get("precision")
    values = precision if isinstance(precision, (tuple, list)) else (precision,)
    for value in values:
        if value == lax.Precision.HIGHEST:
            return True
        if isinstance(value, lax.DotAlgorithmPreset) and value.name in _FULL_PRECISION_ALGORITHMS:
            return True
    return False


def declares_result_types(params: dict) -> bool:
    """True for primitives whose params fix their result types, callbacks (`pure_callback`,
    `io_callback`, `debug_callback`) and FFI calls: they must see the dtypes they were traced
    with."""
    return "result_avals" in params or "callback" in params


def array_literals(eqns: Iterable[JaxprEqn]) -> list:
    """The values of the array literals the equations `eqns` read (closed-over arrays, under
    `jax_use_simplified_jaxpr_constants`)."""
    return [a.val for eqn in eqns for a in eqn.invars
            if isinstance(a, Literal) and isinstance(a.val, jax.Array)]


def without_dead_code(jaxpr: Jaxpr) -> Jaxpr:
    """`jaxpr` without the equations whose results nothing uses and that have no effects,
    in its sub-jaxprs too (a scan's unused outputs, a cond branch's): the program `jax.jit`
    lowers, which runs this same pass first (`jax.make_jaxpr` and `Traced.jaxpr` keep the dead
    equations). Not public: `partial_eval.dce_jaxpr` and its per-primitive rules."""
    from jax._src.interpreters import partial_eval as _pe
    live, _ = _pe.dce_jaxpr(jaxpr, [True] * len(jaxpr.outvars), instantiate=True)
    return live


def innermost_autodiff(x) -> str | None:
    """Which differentiation acts innermost on `x`: "forward" (`jax.jvp`, `jax.jacfwd`),
    "reverse" (`jax.grad`, `jax.vjp`, which linearize) or None (none, or none visible from
    here: a staged region such as a `jax.jit` body hides the transforms applied outside it).
    `vmap` is looked through. `jamp.autograd.Function` uses it to pick forward mode's
    `custom_jvp` path for a class that has both a jvp and a backward: no public API tells a
    jvp from a linearization."""
    while isinstance(x, jax.core.Tracer):
        if isinstance(x, _ad.JVPTracer):
            return "forward"
        if isinstance(x, _ad.LinearizeTracer):
            return "reverse"
        if not isinstance(x, _batching.BatchTracer):
            return None
        x = x.val
    return None


# -- anomaly detection, grad mode and forward-mode AD -----------------------------------------

def jit_keyed_enum_state(name: str, values: Sequence[str], default: str, help: str):
    """A JAX config option (thread-local, with a context-manager form) that `jax.jit` keys its
    cache on, so a jitted function is traced again when it changes. Anomaly mode is one: it is
    read while a function is traced. `jax.config` has no public way to define an option."""
    try:
        return _config.enum_state(name, list(values), default, help=help,
                                  include_in_jit_key=True, include_in_trace_context=True)
    except TypeError:  # a jax whose options have no separate trace-context flag
        return _config.enum_state(name, list(values), default, help=help,
                                  include_in_jit_key=True)


def value_checks_global() -> tuple[bool, bool]:
    """The process-wide values of `jax_debug_nans` and `jax_debug_infs`, under any
    `with jax.debug_nans(...)` of this thread: what a statement that sets them for the process
    restores. `jax.config` reads only the value in effect here."""
    return _config.debug_nans.get_global(), _config.debug_infs.get_global()


def set_in_this_thread(state) -> bool:
    """Whether a `with` block of this thread has set the JAX config option `state`, so that the
    thread reads the block's value, not the process's. Not public: the thread's own value."""
    return state.get_local() is not _config.config_ext.unset


# The modules of JAX that raise `FloatingPointError` when `jax_debug_nans` / `jax_debug_infs`
# finds a value: eager operations and jitted calls (pjit, api), the op-by-op rerun of a jitted
# call or backward pass (api_util), shard_map, and scipy's ndtri.
_VALUE_CHECK_RAISERS = ("jax._src.api", "jax._src.api_util", "jax._src.pjit",
                        "jax._src.shard_map", "jax._src.scipy.special")


def raise_value_checks_as(error_type: type[FloatingPointError] | None) -> None:
    """Makes JAX's `jax_debug_nans` / `jax_debug_infs` checks raise `error_type` (a subclass of
    `FloatingPointError`), in every thread, or `FloatingPointError` again with None.

    JAX gives no hook for the type of that error, and raises it deep in its dispatch, inside
    the user's code: nothing around the user's call can retype it before the user's own
    `except` sees it. Its modules name the builtin `FloatingPointError` at each raise (and in
    the `except` of their op-by-op rerun), so a module global of that name shadows it there.
    Not public: the modules and their use of the builtin's name."""
    for name in _VALUE_CHECK_RAISERS:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError:  # a jax without that module raises from the others
            continue
        if error_type is None:
            vars(module).pop("FloatingPointError", None)
        else:
            module.FloatingPointError = error_type  # type: ignore[attr-defined]


def unfiltered_tracebacks():
    """A context in which JAX keeps its own frames in the tracebacks of the errors it raises.

    When `jax_debug_nans` finds a NaN in the output of a `jax.jit` function, JAX runs the
    function again op by op and raises `FloatingPointError` at the primitive that made it. In a
    backward pass that primitive is evaluated from an equation whose source info names the
    user's forward line, but the error JAX raises from a jitted function drops that record;
    only JAX's own frames, still evaluating the equation, hold it (`error_source`). Not public:
    the option is one of JAX's config states, set for this thread.
    """
    return _config.traceback_filtering("off")


def filter_traceback(error: BaseException) -> None:
    """Filters JAX's frames out of `error`'s traceback as JAX's API boundary does under the
    traceback filtering now in effect (nothing when it is off), each kept entry at the line it
    was raised through. Not public: JAX's filter and its modes."""
    tb = error.__traceback__
    mode = _traceback_util._filtering_mode()
    if tb is None or mode == "off":
        return
    if mode == "tracebackhide":
        _traceback_util._add_tracebackhide_to_hidden_frames(tb)
        return
    kept = []
    while tb is not None:
        if _traceback_util.include_frame(tb.tb_frame):
            kept.append(tb)
        tb = tb.tb_next
    filtered = None
    for entry in reversed(kept):
        filtered = types.TracebackType(filtered, entry.tb_frame, entry.tb_lasti,
                                       entry.tb_lineno)
    error.with_traceback(filtered)


def error_source(tb) -> list[tuple[str, int, str]]:
    """The user's frames (`(file, line, function)`, outermost first) that made the error whose
    unfiltered traceback is `tb`, where the innermost of them decides: a frame of user code
    (the error came from the line it runs), or frames of JAX (or of jamp) evaluating jaxpr
    equations (it came from those equations, and their source info names the user's lines that
    created them: the forward line, for an equation of a backward pass). For the first, the
    traceback's user frames; for the second, the equations', a call's before its body's (a
    body records its frames from the body inwards), or the traceback's user frames where the
    equations name none. Empty when neither is found.
    Not public: frames hold JAX's internal locals, `source_info` is an internal field."""
    frames: list[tuple[str, int, str]] = []
    equations: list[JaxprEqn] = []
    while tb is not None:
        frame = tb.tb_frame
        found = next((v for v in frame.f_locals.values() if isinstance(v, JaxprEqn)), None)
        if found is not None:
            equations.append(found)
        elif (_source_info.is_user_filename(frame.f_code.co_filename)
              and not frame.f_code.co_filename.startswith(JAMP_DIR)):
            frames.append((frame.f_code.co_filename, tb.tb_lineno, frame.f_code.co_name))
            equations = []
        tb = tb.tb_next
    if not equations:
        return frames
    chain: list[tuple[str, int, str]] = []
    for eqn in equations:
        chain += [f for f in user_frames(eqn) if f not in chain]
    # Equations of a jitted library function's body (newer jax jits `jnp.log`) name no user
    # line: the user's frames that called it do.
    return chain or frames


# jamp's own source files: their frames are never the user's line that a tool names.
JAMP_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def user_frames(eqn: JaxprEqn) -> list[tuple[str, int, str]]:
    """The user's frames (`(file, line, function)`, outermost first) of the Python stack that
    created `eqn`: its source info, which JAX keeps on every equation and copies from a forward
    equation onto the equations that differentiate it. JAX's own frames and the standard
    library's are left out (JAX's filter). Not public: `source_info` is an internal field."""
    frames = _source_info.user_frames(eqn.source_info.traceback)
    return [(f.file_name, f.start_line, f.function_name) for f in frames][::-1]


def traceback_code(eqn: JaxprEqn) -> tuple[Any, ...]:
    """The code objects of the Python stack that created `eqn`, innermost first: JAX records
    the frames from the function being traced inward (a `jax.jit` body's equations name the
    jitted function and what it called, not its callers), keeps them on every equation and
    copies them onto the equations that differentiate it. What precision rules naming a
    function match (`jamp.transforms.rules`). Not public: `source_info` is an internal field."""
    return _traceback_code(eqn.source_info)


def current_traceback_code() -> tuple[Any, ...]:
    """The code objects of the Python stack now, innermost first: what `traceback_code` reads
    off an equation traced at this point. Not public: JAX's `source_info_util`."""
    return _traceback_code(_source_info.current())


def _traceback_code(source_info) -> tuple[Any, ...]:
    traceback = source_info.traceback
    return () if traceback is None else tuple(traceback.raw_frames()[0])


def source_key(eqn: JaxprEqn) -> int:
    """An identity for the Python stack that created `eqn`, shared with the equations that
    differentiate it (transposition re-enters the forward equation's traceback object)."""
    return id(eqn.source_info.traceback)


def custom_call_name(params: dict) -> str | None:
    """The name of the function a custom_jvp_call / custom_vjp_call wraps (`relu`), from its
    primal body's debug info."""
    body = params.get("call_jaxpr")
    info = getattr(getattr(body, "jaxpr", body), "debug_info", None)
    return getattr(info, "func_name", None)


def autodiff_kinds(x) -> frozenset[str]:
    """The kinds of differentiation acting on `x` at the levels visible from here, looking
    through vmap: "forward" (`jax.jvp`, `jax.jacfwd`) and "reverse" (`jax.grad`, `jax.vjp`,
    which linearize). `jax.hessian` (a jacfwd of a jacrev) shows both. A `jax.custom_vjp` cannot
    be differentiated in forward mode at all, so what builds one needs to know."""
    kinds = set()
    while isinstance(x, jax.core.Tracer):
        if isinstance(x, _ad.JVPTracer):
            kinds.add("forward")
            x = x.primal
        elif isinstance(x, _ad.LinearizeTracer):
            kinds.add("reverse")
            x = x.primal
        elif isinstance(x, _batching.BatchTracer):
            x = x.val
        else:
            break
    return frozenset(kinds)


def tracing() -> bool:
    """True while some JAX transformation (jit, grad, vmap, a dual level...) is tracing: a
    `with` block there cannot change how the traced values are differentiated."""
    from jax._src import core as _core
    return not _core.trace_state_clean()


def staging() -> bool:
    """True while the code running is being staged into a program (`jax.jit`, a `lax.scan`
    body, `jax.checkpoint`), under whatever transformations; False while it runs eagerly,
    transformed or not (an eager `jax.grad` or `jax.vmap` dispatches each primitive as it
    goes). Not public: the trace stack and `DynamicJaxprTrace`."""
    from jax._src import core as _core
    from jax._src.interpreters import partial_eval as _pe
    trace = _core.trace_ctx.trace
    while trace is not None:
        if isinstance(trace, _pe.DynamicJaxprTrace):
            return True
        trace = getattr(trace, "parent_trace", None)
    return False


class JVPLevel:
    """A forward-mode differentiation level that stays open between `open()` and `close()`:
    torch's dual level. While it is open every primitive is bound through a `JVPTrace` (the
    trace `jax.jvp` runs a function under), so values made dual with `dual()` carry their
    tangents through ordinary code. `jax.jvp` offers only the function form; a level opened and
    closed by a `with` statement needs the trace itself."""

    def __init__(self):
        from jax._src import core as _core
        with _core.take_current_trace() as parent:
            self.trace = _ad.JVPTrace(parent, _core.TraceTag())
        self._context = _core.set_current_trace(self.trace)
        self._open = False

    def open(self) -> None:
        self._context.__enter__()
        self._open = True

    def close(self) -> None:
        if self._open:
            self._open = False
            self._context.__exit__(None, None, None)

    def dual(self, primal, tangent):
        """`primal` carrying `tangent` at this level."""
        return _ad.JVPTracer(self.trace, primal, tangent)

    def owns(self, x) -> bool:
        """True for a value that carries a tangent at this level."""
        return isinstance(x, _ad.JVPTracer) and x._trace.tag is self.trace.tag

    def split(self, x) -> tuple[Any, Any]:
        """`(primal, tangent)` of `x` at this level; the tangent is None where `x` carries none
        (a symbolic zero)."""
        if not self.owns(x):
            return x, None
        tangent = x.tangent
        return x.primal, None if isinstance(tangent, _ad.Zero) else tangent


def scan_parts(params: dict) -> tuple[ClosedJaxpr, int, int, dict]:
    """A scan equation's body, its numbers of consts and carries, and the `lax.scan` keywords
    (`length`, `reverse`, `unroll`) that rebuild it with another body."""
    options = dict(length=params["length"], reverse=params["reverse"], unroll=params["unroll"])
    if "_split_transpose" in params:
        options["_split_transpose"] = params["_split_transpose"]
    if "ft_in" in params:
        # From jax 0.11 the inputs' grouping is a flat tree of (consts, carries, xs).
        consts, carries, _ = params["ft_in"].unpack()
        num_consts, num_carry = len(consts), len(carries)
    else:
        num_consts, num_carry = params["num_consts"], params["num_carry"]
    return _as_closed(params["jaxpr"]), num_consts, num_carry, options


def while_parts(params: dict) -> tuple[ClosedJaxpr, ClosedJaxpr, int, int]:
    """A while equation's condition and body, and their numbers of consts (the equation's
    inputs are the condition's consts, the body's, then the carries)."""
    return (_as_closed(params["cond_jaxpr"]), _as_closed(params["body_jaxpr"]),
            params["cond_nconsts"], params["body_nconsts"])


def is_backward(eqn: JaxprEqn) -> bool:
    """True for an equation of a backward pass: `jax.grad`/`jax.vjp` put a `transpose`
    transformation on the name stack of every equation they transpose (an equation of a
    call's body records only its own scopes: the call's equation holds the mark). Not
    public: the name stack's `Transform` entries are internal types."""
    return any(isinstance(entry, _source_info.Transform) and entry.name == "transpose"
               for entry in eqn.source_info.name_stack.stack)


def scope_names(eqn: JaxprEqn) -> list[str]:
    """The `jax.named_scope` names on an equation's name stack, outermost first: Flax linen
    module paths (`Model`, `Dense_0`), user scopes and autocast regions; the transformations
    wrapped around them (`jvp(...)`, `transpose(...)`) are left out. Not public: the name
    stack's `Scope` entries are internal types."""
    return _scope_names(eqn.source_info.name_stack)


def current_scope_names() -> list[str]:
    """The `jax.named_scope` names open now in the function being traced, outermost first:
    what `scope_names` reads off an equation traced at this point (JAX traces the body of a
    jit, scan, cond or checkpoint on a name stack of its own). Not public: JAX's
    `source_info_util`."""
    return _scope_names(_source_info.current_name_stack())


def _scope_names(name_stack) -> list[str]:
    return [entry.name for entry in name_stack.stack if isinstance(entry, _source_info.Scope)]


def live_executables() -> list[Any]:
    """The runtime executables (`jaxlib` `LoadedExecutable`s, with `hlo_modules()`) of every
    compiled JAX program still alive in this process, however it was compiled: `jax.jit`'s
    own cache, `.lower().compile()`, eager op dispatch.

    The profiler needs them to read the HLO of the programs that ran in a trace, which names
    them only by module name and program id; JAX keeps no public registry of what it compiled.
    `jax._src.stages.Executable` is the base of every compiled program (`runtime_executable()`
    is what the public `jax.stages.Compiled` returns); the garbage collector finds the live ones.
    """
    import gc
    from jax._src import stages as _stages
    found = []
    for obj in gc.get_objects():
        # type(), not isinstance: some objects (lazy modules) answer `__class__` with a
        # deprecation warning or an import.
        if issubclass(type(obj), _stages.Executable):
            try:
                runtime = obj.runtime_executable()
            except Exception:  # an executable kind without a runtime one (e.g. a fallback)
                continue
            if runtime is not None and hasattr(runtime, "hlo_modules"):
                found.append(runtime)
    return found


def mxfp8_dot_general(lhs, rhs, dimension_numbers, out_dtype) -> Callable | None:
    """`jax.nn.scaled_dot_general` with mxfp8 for all three GEMMs, as `fn(lhs, rhs)`; None
    where this jax has none or its shape rules refuse these operands.

    For `jamp.fp8`'s mxfp8 recipe, which runs it where it lowers (cuDNN's block-scaled GEMM on
    CUDA). Its rules (blocks of 32 along every GEMM's contracting dimensions, in the layouts it
    takes) are asserts in its tracing, not a public predicate: a trial trace of the product and
    its pullback at the operands' shapes asks them.
    """
    scaled = getattr(jax.nn, "scaled_dot_general", None)
    if scaled is None:
        return None
    configs = [jax.nn.get_scaled_dot_general_config("mxfp8")] * 3

    def fn(lhs, rhs):
        # scaled_dot_general's gradients come back in its result's dtype: the operands are
        # widened (exactly) to the widest of theirs and the result's, so that each gradient
        # returns to its own operand's dtype, as the emulation's do (the branches of the
        # cond `lax.platform_dependent` builds must agree on them).
        wide = jax.numpy.result_type(lhs, rhs, out_dtype)
        return scaled(lhs.astype(wide), rhs.astype(wide), dimension_numbers,
                      preferred_element_type=wide, configs=configs).astype(out_dtype)

    def product_and_pullback(lhs, rhs):
        out, pullback = jax.vjp(fn, lhs, rhs)
        return pullback(out)

    try:
        jax.eval_shape(product_and_pullback, _spec(jax.typeof(lhs)), _spec(jax.typeof(rhs)))
    except (AssertionError, ValueError, TypeError):
        return None
    return fn
