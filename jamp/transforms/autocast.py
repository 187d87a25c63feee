"""`jamp.autocast`: torch.autocast as a JAX function transform, and its regions."""

from __future__ import annotations

import collections
import dataclasses
import functools
import inspect
import weakref
from typing import Any, Callable

import jax
import numpy as np
from jax.extend import core as jex_core

from jamp.policy.autocast_tables import OpTable, autocast_table, canonical_device_type
from jamp.transforms import _jax_internals as jx
from jamp.transforms import _nnx_internals as nnx_state
from jamp.transforms import autocast_rules as rules
from jamp.transforms import boundary, interpreter


def autocast(
    fn: Callable | str | None = None,
    *,
    device_type: str | None = None,
    dtype: Any = None,
    enabled: bool = True,
    cache_enabled: bool | None = None,
    op_table: OpTable | None = None,
    cast_outputs: bool = True,
):
    """torch.autocast for JAX: runs `fn` with each op in the dtype its device's table says.

    With `fn`, returns the transformed function: it traces `fn` to a jaxpr and evaluates it
    with matmuls and convolutions in `dtype`, the ops of the float32 list in float32 and every
    other op in the widest floating dtype of its inputs. It composes with `jax.jit`,
    `jax.grad` (the backward runs in the forward's dtypes, grads come back in the params'
    dtypes), `jax.vmap` and sharding. Array arguments (any pytree) are traced; other leaves
    (Python scalars, strings, flags) are passed through as static values. NNX modules, as
    arguments or closed over, are updated as the call without autocast would update them.
    The transformed program is cached per input types and static values, as `jax.jit` caches:
    a repeated call does not trace `fn` again (arguments, NNX state and closed-over arrays are
    still read afresh on every call).

    Without `fn`, returns an `AutocastRegion`: used as a decorator it transforms the function;
    used as `with jamp.autocast(enabled=False):` (or `dtype=...`) inside a function being
    transformed, it marks a region whose ops run with autocast off (their inputs cast back to
    the dtypes the program was written in, float32 for a float32 program) or in another dtype.
    Regions nest. A region outside any transformed function does nothing.

    torch's call form works too: a device type string first, `jamp.autocast("cuda",
    dtype=jnp.float16)`, as a region, a decorator or applied to a function.

    Args:
      fn: the function to transform, or torch's positional device type.
      device_type: "cuda"/"gpu", "cpu" or "tpu"; default: `jax.default_backend()`.
      dtype: the low dtype; default float16 on cuda/gpu, bfloat16 on cpu and tpu. float16 on
        the CPU works: XLA emulates it.
      enabled: False returns `fn` unchanged (as a region: autocast off inside).
      cache_enabled: accepted for torch compatibility (default True). True casts each value
        to each dtype once per (sub-)program, so a weight used by several matmuls is converted
        once; False emits a convert per use, which XLA's CSE usually merges again.
      op_table: a custom `OpTable` (see `jamp.transforms.autocast_table(...).updated(...)`).
      cast_outputs: True (default) returns outputs in the dtypes `fn` returns; False keeps the
        dtypes autocast computed them in (e.g. bfloat16 logits), torch's behaviour.

    Raises:
      ValueError: for an unknown `device_type` or a `dtype` that is not float16, bfloat16 or
        float32, naming the accepted ones.
      TypeError: for a first argument that is neither a function nor a device type string, or
        a device type given both ways.

    Example:
      >>> loss = jamp.autocast(loss_fn, dtype=jnp.bfloat16)
      >>> grads = jax.jit(jax.grad(loss))(params, batch)
    """
    if isinstance(fn, str):  # torch.autocast("cuda", ...)
        if device_type is not None:
            raise TypeError(
                f"jamp.autocast got the device type twice: {fn!r} as its first argument and "
                f"device_type={device_type!r}.")
        fn, device_type = None, fn
    elif fn is not None and not callable(fn):
        raise TypeError(
            f"jamp.autocast's first argument must be a function to transform or a device type "
            f"string such as 'cuda' (torch's form); got {fn!r} of type {type(fn).__name__}.")
    region = AutocastRegion(device_type=device_type, dtype=dtype, enabled=enabled,
                            cache_enabled=cache_enabled, op_table=op_table,
                            cast_outputs=cast_outputs)
    return region if fn is None else region(fn)


class AutocastRegion:
    """The object `jamp.autocast()` returns without a function: a decorator (the transform)
    and a context manager (a region inside a transformed function)."""

    def __init__(self, *, device_type=None, dtype=None, enabled=True, cache_enabled=None,
                 op_table=None, cast_outputs=True):
        if not isinstance(enabled, bool):
            raise ValueError(f"enabled={enabled!r}: expected True or False.")
        self._explicit_device = device_type is not None
        if device_type is None:
            device_type = op_table.device_type if op_table is not None else jax.default_backend()
        self.device_type = canonical_device_type(device_type)
        self.table = op_table if op_table is not None else autocast_table(self.device_type)
        self._explicit_dtype = dtype is not None
        self.dtype = (rules.check_autocast_dtype(dtype) if dtype is not None
                      else self.table.default_dtype)
        self.enabled = enabled
        self.cache_enabled = True if cache_enabled is None else bool(cache_enabled)
        self.cast_outputs = cast_outputs
        self._custom_table = op_table is not None
        self._scopes: list = []

    def __repr__(self):
        return (f"autocast(device_type={self.device_type!r}, dtype={self.dtype.name}, "
                f"enabled={self.enabled}, cache_enabled={self.cache_enabled})")

    @property
    def scope_name(self) -> str:
        """The `jax.named_scope` name that marks this region in a traced program."""
        return rules.marker(
            enabled=self.enabled,
            device=self.device_type if self._explicit_device else None,
            dtype=self.dtype if self._explicit_dtype else None)

    def __enter__(self):
        if self._custom_table:
            raise ValueError(
                "op_table applies to a transform (jamp.autocast(fn, op_table=...)); a region "
                "(`with jamp.autocast(...)`) sets only enabled, dtype and device_type.")
        scope = jax.named_scope(self.scope_name)
        scope.__enter__()
        self._scopes.append(scope)
        return self

    def __exit__(self, *exc):
        return self._scopes.pop().__exit__(*exc)

    def __call__(self, fn: Callable) -> Callable:
        if not callable(fn):
            raise TypeError(f"autocast(...) decorates a function; got {fn!r} of type "
                            f"{type(fn).__name__}.")
        if not self.enabled:
            @functools.wraps(fn)
            def disabled(*args, **kwargs):
                with jax.named_scope(self.scope_name):
                    return fn(*args, **kwargs)
            return disabled

        region = rules.Region(enabled=True, dtype=self.dtype, table=self.table)
        settings = (region, self.cache_enabled, self.cast_outputs)

        @functools.wraps(fn)
        def transformed(*args, **kwargs):
            call = boundary.Call.of(fn, args, kwargs)
            cache = _program_cache(fn)
            key = (settings, call.key)
            program = cache.get(key)
            if program is None:
                program = _Program.build(fn, call, region, self.cache_enabled,
                                         self.cast_outputs)
                if program.cacheable:
                    cache.put(key, program)
            with jax.named_scope(self.scope_name):
                return program.run(call)

        return transformed


@dataclasses.dataclass
class _Program:
    """A traced and transformed call: what a repeated call with the same key runs.

    Attributes:
      jaxpr: the transformed program. Inputs: the call's traced arrays, its NNX variables'
        values, then the closed-over arrays it reads (`lifted`). Outputs: the array outputs,
        then the new values of the variables the function updated (`updated`).
      lifted: indices into the call's closure arrays.
      updated: indices into the call's variables.
      out_tree / statics: the output structure, and the outputs that are not arrays (returned
        as the function returned them when it was traced).
      num_outputs: how many array outputs there are.
      cacheable: False when the program holds values a later call cannot supply afresh:
        tracers of an enclosing transform, or arrays reached through objects the closure walk
        does not enter. Such a call is traced again each time.
    """

    jaxpr: Any
    lifted: tuple
    updated: tuple
    out_tree: Any
    statics: dict
    num_outputs: int
    cacheable: bool
    compiled: Callable

    @classmethod
    def build(cls, fn, call: boundary.Call, region, cache_enabled, cast_outputs) -> "_Program":
        traced = _trace_user_function(fn, call)
        user = traced["jaxpr"]
        lifted, slots, cacheable = _lift_closure_arrays(user, call, traced["live"])
        num_outputs, num_in = traced["num_outputs"], len(user.in_avals)

        def program(*inputs):
            consts = list(user.consts)
            for slot, value in zip(slots, inputs[num_in:]):
                consts[slot] = value
            ctx = interpreter.Context(cache_enabled=cache_enabled)
            outs = interpreter.eval_jaxpr(user, inputs[:num_in], region, ctx, consts=consts)
            outputs, updates = outs[:num_outputs], outs[num_outputs:]
            if cast_outputs:
                outputs = interpreter.cast_to_avals(outputs, user.out_avals[:num_outputs])
            # NNX state keeps its dtype whatever cast_outputs says.
            return outputs + interpreter.cast_to_avals(updates, user.out_avals[num_outputs:])

        avals = list(user.in_avals) + [jx.typeof(call.closure.arrays[k]) for k in lifted]
        jaxpr = jx.trace_closed(program, avals)
        cacheable = cacheable and not any(jx.is_tracer(c) for c in jaxpr.consts)
        return cls(jaxpr, lifted, traced["updated"], traced["out_tree"], traced["statics"],
                   num_outputs, cacheable,
                   jax.jit(jex_core.jaxpr_as_fun(jaxpr)))

    def run(self, call: boundary.Call):
        inputs = call.inputs + [call.closure.arrays[k] for k in self.lifted]
        if any(map(jx.is_tracer, inputs)) or not self.cacheable:
            outs = jex_core.jaxpr_as_fun(self.jaxpr)(*inputs)
        else:
            # An eager call: run the cached program compiled, as jax.jit runs its cache.
            outs = self.compiled(*inputs)
        outs = list(outs)
        for index, value in zip(self.updated, outs[self.num_outputs:]):
            nnx_state.write_back(call.variables[index], value)
        arrays = iter(outs[:self.num_outputs])
        leaves = [self.statics[i] if i in self.statics else next(arrays)
                  for i in range(self.out_tree.num_leaves)]
        return jax.tree_util.tree_unflatten(self.out_tree, leaves)


def _trace_user_function(fn, call: boundary.Call) -> dict:
    """Traces `fn` on the call's traced inputs, its NNX state borrowed; returns the jaxpr and
    what the trace saw (output structure, static outputs, updated variables, live arrays)."""
    found: dict = {}
    num_arrays = len(call.traced)

    def flat_fn(*flat):
        args, kwargs = call.arguments(flat[:num_arrays])
        values = flat[num_arrays:]
        with nnx_state.borrowed(call.variables, values, call.nodes):
            result = fn(*args, **kwargs)
            finals = [nnx_state.value(v) for v in call.variables]
        updated = tuple(i for i, (new, old) in enumerate(zip(finals, values)) if new is not old)
        leaves, out_tree = jax.tree_util.tree_flatten(result, is_leaf=call.is_borrowed)
        arrays = [i for i, x in enumerate(leaves) if _is_output_array(x)]
        found.update(out_tree=out_tree, updated=updated, num_outputs=len(arrays),
                     statics={i: x for i, x in enumerate(leaves) if i not in set(arrays)})
        return [leaves[i] for i in arrays] + [finals[i] for i in updated]

    jx.with_debug_info(flat_fn, fn, boundary.arg_names(fn, call))
    live = jax.live_arrays()  # held while tracing, so that their ids stay theirs
    found["jaxpr"] = jx.trace_closed(flat_fn, [jx.typeof(x) for x in call.inputs])
    found["live"] = {id(a) for a in live}
    return found


def _lift_closure_arrays(user, call: boundary.Call, live: set) -> tuple[tuple, tuple, bool]:
    """Which consts of the traced program are closed-over arrays the call can pass afresh.

    Returns (indices into the closure's arrays, the const slots they fill, cacheable): a const
    that existed before the trace but was not found in the closure (an array reached through
    an object's attributes) or that is a tracer cannot be passed afresh, so the program is not
    cached.
    """
    found = {id(a): k for k, a in enumerate(call.closure.arrays)}
    lifted, slots, cacheable = [], [], True
    for slot, const in enumerate(user.consts):
        k = found.get(id(const))
        if k is not None:
            lifted.append(k)
            slots.append(slot)
        elif jx.is_tracer(const) or id(const) in live:
            cacheable = False
    return tuple(lifted), tuple(slots), cacheable


def _is_output_array(x) -> bool:
    return isinstance(x, (jax.Array, np.ndarray))


class _LRU:
    """A small least-recently-used map of programs."""

    def __init__(self, size: int = 32):
        self.size = size
        self.items: collections.OrderedDict = collections.OrderedDict()

    def get(self, key):
        try:
            self.items.move_to_end(key)
        except KeyError:
            return None
        return self.items[key]

    def put(self, key, value) -> None:
        self.items[key] = value
        self.items.move_to_end(key)
        while len(self.items) > self.size:
            self.items.popitem(last=False)


# Programs are cached per user function (a weak reference: the cache goes with the function),
# so that `jamp.autocast(loss)` built again each step still finds them, as `jax.jit(loss)` does.
_PROGRAMS: "weakref.WeakKeyDictionary[Any, _LRU]" = weakref.WeakKeyDictionary()


def _program_cache(fn) -> _LRU:
    owner = _cache_owner(fn)
    try:
        cache = _PROGRAMS.get(owner)
        if cache is None:
            cache = _PROGRAMS[owner] = _LRU()
        return cache
    except TypeError:  # not weakly referenceable: a cache of its own for this call
        return _LRU()


def _cache_owner(fn):
    """The function whose code a call runs: bound methods, partials and callable objects
    share their function's cache (their object and arguments are part of the key)."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    if inspect.ismethod(fn):
        return fn.__func__
    if not inspect.isfunction(fn) and inspect.isfunction(getattr(type(fn), "__call__", None)):
        return type(fn).__call__
    return fn
