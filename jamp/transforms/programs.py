"""The programs an autocast function runs: the user's function traced on every call, its
autocast transformation built once per distinct trace, cached, and checked before reuse.

`Trace` traces the user's function on a call's traced arrays and NNX state (`boundary.Call`),
with the NNX state borrowed (`_nnx_internals`), and records what came out (array outputs, values
and objects handed back as they are, the state the function left). It runs on every call, as an
eager call runs the function: whatever Python state the function reads (an object's field, a
global, a list) is read afresh, and no key has to foresee it. `Trace.key` says when two traces
make the same program: the same equations, literals, closed-over constants and records.
`Program.build` turns the closed-over arrays the program uses into inputs and traces the
autocast interpretation of it all into one jaxpr, what the cache saves (with its compile).
`Program.run` runs that jaxpr for a call, compiled when the call is eager, and writes the NNX
state back. A program built for the delayed fp8 recipe's state (`jamp.fp8.with_state`) takes
its sites' states as further inputs (`autocast_delayed`). `cache_for(fn)` holds the programs
of one user function.
"""

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

from jamp import _jax_internals as jx
from jamp.transforms import _nnx_internals as nnx_state
from jamp.transforms import autocast_delayed, boundary, interpreter, nnx_scopes
from jamp.transforms import rules as precision_rules
from jamp.walker.walk import equations

# How a leaf of an output or of the NNX state is produced on each call:
#   ("out", k): the k-th array output of the program;
#   ("in", i): the call's i-th traced input, unchanged;
#   ("value", v): v, as the trace produced it (an immutable Python value);
#   ("object", j): the call's j-th NNX object (a module or Variable handed back).
Source = tuple  # one of the above


@dataclasses.dataclass
class Program:
    """A traced and transformed call: what a repeated call with the same key runs.

    Attributes:
      jaxpr: the transformed program. Inputs: the call's traced inputs (`Call.inputs`), then
        the closed-over arrays it uses (`lifted`). Outputs: arrays, see `Source`.
      lifted: indices of those arrays among the call's `Reach.arrays`.
      result: the output's structure and a `Source` per leaf.
      writes: for each NNX slot the function changed, (slot index, value structure, a
        `Source` per leaf).
      cacheable: False when a later call could not be served right: the program holds
        tracers of an enclosing transform, hands back a mutable object, or changed the
        structure of an NNX module (its new objects are this call's). Such a program runs
        once.
      state: the NNX state the writes and objects refer to when the program is not cacheable
        (a cacheable one uses each call's own, which has the same structure).
      adopted: objects the function created and attached to a module, made the caller's.
      guards: checks a cached program passes before it is reused (see `valid_for`).
      compiled: the program jit-compiled, for eager calls.
      sites: the delayed fp8 sites of a program built for delayed state, whose states are
        its last inputs (`autocast_delayed`); None for a program built without.
    """

    jaxpr: Any
    lifted: tuple
    result: tuple
    writes: list
    cacheable: bool
    state: Any
    adopted: list
    guards: list
    compiled: Callable
    sites: tuple | None = None

    @classmethod
    def build(cls, fn, traced: "Trace", call: boundary.Call, region, cache_enabled: bool,
              cast_outputs: bool, delayed: bool = False) -> "Program":
        """The program of `traced`; with `delayed`, taking the delayed fp8 sites' states
        after its inputs (the sites found by a first, discovering trace)."""
        user = traced.jaxpr
        lifted, slots, cacheable = _lift_closure_arrays(user, call)
        num_in, num_results = len(user.in_avals), traced.num_results
        num_inputs = num_in + len(lifted)
        contexts = []

        def program(*inputs, sites=None):
            consts = list(user.consts)
            substitutes = {}
            for slot, k, value in zip(slots, lifted, inputs[num_in:num_inputs], strict=True):
                if slot is None:  # a literal of the program (see _lift_closure_arrays)
                    substitutes[id(call.reach.arrays[k])] = value
                else:
                    consts[slot] = value
            ctx = interpreter.Context(cache_enabled=cache_enabled, substitutes=substitutes,
                                      delayed=sites)
            if sites is None or not sites.discovering:
                contexts.append(ctx)
            outs = interpreter.eval_jaxpr(user, inputs[:num_in], region, ctx, consts=consts)
            results, state = outs[:num_results], outs[num_results:]
            if cast_outputs:
                results = interpreter.cast_to_avals(results, user.out_avals[:num_results])
            # NNX state keeps its dtype whatever cast_outputs says.
            return results + interpreter.cast_to_avals(state, user.out_avals[num_results:])

        avals = list(user.in_avals) + [jax.typeof(call.reach.arrays[k]) for k in lifted]
        sites = None
        if delayed:
            discovering = autocast_delayed.Sites()
            jx.trace_closed(lambda *inputs: program(*inputs, sites=discovering), avals)
            sites = discovering.sites()
            avals += autocast_delayed.state_avals(sites)

        def with_states(*inputs):
            running = (None if sites is None
                       else autocast_delayed.Sites.running(sites, inputs[num_inputs:]))
            return program(*inputs[:num_inputs], sites=running)

        jaxpr = jx.trace_closed(with_states, avals)
        if region.scope is not None:
            ctx, = contexts
            precision_rules.check_matched(region.scope.rules, ctx.decided, ctx.places,
                                          traced.fn_name, ctx.overridden)
        cacheable = (cacheable and traced.cacheable and call.key is not None
                     and not any(jx.is_tracer(c) for c in jaxpr.consts))
        return cls(jaxpr, lifted, traced.result, traced.writes, cacheable,
                   None if cacheable else traced.state_after, traced.adopted,
                   _guards(call), jax.jit(jex_core.jaxpr_as_fun(jaxpr)), sites)

    def valid_for(self, call: boundary.Call) -> bool:
        """What the key cannot say: the objects it names by identity are the same objects
        (not others that reuse a dead one's id), and so are the numpy arrays the call
        reached, with the same contents where they are small."""
        return all(check(call) for check in self.guards)

    def initial_state(self) -> dict:
        """Fresh states of the program's delayed fp8 sites, by key."""
        return autocast_delayed.initial_state(self.sites or ())

    def run(self, call: boundary.Call, delayed_state: Any = None):
        """The outputs of `call`; `delayed_state`, the user's states of the delayed fp8 sites,
        for a program built for them."""
        inputs = call.inputs
        arguments = inputs + [call.reach.arrays[k] for k in self.lifted]
        if self.sites is not None:
            arguments += autocast_delayed.state_leaves(self.sites, delayed_state)
        if self.cacheable and not any(map(jx.is_tracer, arguments)):
            # An eager call: run the cached program compiled, as jax.jit runs its cache.
            outs = self.compiled(*arguments)
        else:
            outs = jex_core.jaxpr_as_fun(self.jaxpr)(*arguments)
        state = call.state if self.state is None else self.state
        objects = state.objects()

        def produce(source: Source):
            kind, where = source
            if kind == "out":
                return outs[where]
            if kind == "in":
                return inputs[where]
            if kind == "object":
                return objects[where]
            return where

        nnx_state.adopt(self.adopted)
        for index, tree, sources in self.writes:
            state.slots[index].write(jax.tree_util.tree_unflatten(tree, map(produce, sources)))
        tree, sources = self.result
        return jax.tree_util.tree_unflatten(tree, map(produce, sources))


class Trace:
    """Traces the user's function on a call's inputs, its NNX state borrowed, and records
    where each output and each changed piece of state comes from."""

    def __init__(self, fn, call: boundary.Call):
        self.cacheable = True
        self.adopted: list = []
        self.fn_name = getattr(fn, "__qualname__", repr(fn))
        num_args = len(call.traced)

        def flat_fn(*flat):
            values = call.state_values(flat[num_args:])
            args, kwargs = call.arguments(flat[:num_args])
            with nnx_state.borrowed(call.state, values), nnx_scopes.named_calls(
                    [root for _, root in call.reach.roots]):
                result = fn(*args, **kwargs)
                # Read before the state is restored: a returned nnx.state(m) or submodule
                # holds this trace's values.
                after = nnx_state.State.of(call.reach.roots)
                after_values = after.values()
                objects = {id(o): j for j, o in enumerate(after.objects())}
                leaves, tree = jax.tree_util.tree_flatten(
                    result, is_leaf=lambda x: id(x) in objects)
            return self._record(call, flat, leaves, tree, objects, after, after_values)

        jx.with_debug_info(flat_fn, fn, call.names)
        self.jaxpr = jx.trace_closed(flat_fn, [jax.typeof(x) for x in call.inputs])

    def key(self, call: boundary.Call, region) -> Any:
        """What the program built from this trace depends on, hashable; None when it cannot
        be told (the program is then built for this call alone)."""
        if call.key is None or not self.cacheable:
            return None
        arrays = {id(a): k for k, a in enumerate(call.reach.arrays)}
        traced = _Fingerprint(arrays, with_code=region.scope is not None).closed(self.jaxpr)
        tree, sources = self.result
        writes = tuple((index, value_tree, _typed_sources(sources))
                       for index, value_tree, sources in self.writes)
        key = (call.key, traced, tree, _typed_sources(sources), writes)
        try:
            hash(key)
        except TypeError:  # a Python value handed back or left in the state that cannot be hashed
            return None
        return key

    def _record(self, call, flat, leaves, tree, objects, after, after_values) -> list:
        outputs: list = []
        inputs = {id(x): i for i, x in enumerate(flat)}

        def output(leaf) -> Source:
            outputs.append(leaf)
            return ("out", len(outputs) - 1)

        def result_source(leaf) -> Source:
            if id(leaf) in objects and not boundary.is_array(leaf):
                return ("object", objects[id(leaf)])
            if _is_output_array(leaf):
                return output(leaf)
            if not boundary.is_immutable(leaf):
                self.cacheable = False  # a mutable object must be this call's own
                _check_holds_no_traced_value(leaf, call, self.fn_name)
            return ("value", leaf)

        self.result = (tree, [result_source(leaf) for leaf in leaves])
        self.num_results = len(outputs)

        changed = _structure(after) != _structure(call.state)
        self.writes = []
        for index, value in enumerate(after_values):
            value_leaves, value_tree = jax.tree_util.tree_flatten(value)
            sources = [("in", inputs[id(leaf)]) if id(leaf) in inputs and not changed
                       else output(leaf) if _is_output_array(leaf)
                       else ("value", leaf) for leaf in value_leaves]
            if changed or sources != call.slot_sources(index):
                self.writes.append((index, value_tree, sources))
        if changed:  # new or replaced objects: this call's own
            self.cacheable = False
            known = {id(o) for o in call.state.objects()}
            self.adopted = [o for o in after.objects() if id(o) not in known]
        self.state_after = after
        return outputs


def _check_holds_no_traced_value(value: Any, call: boundary.Call, fn_name: str) -> None:
    """An object returned as it is (not a pytree) must hold no array of this trace: handed
    back, it would leak the tracer (jax.jit refuses every output that is not a JAX type)."""
    reach = boundary.Reach()
    reach.visit("", value)
    outer = {id(x) for x in [*call.inputs, *call.reach.arrays]}
    if any(jx.is_tracer(a) and id(a) not in outer for a in reach.arrays):
        raise TypeError(
            f"{fn_name} returned a {type(value).__qualname__} object holding arrays it "
            "computed: jamp.autocast, as jax.jit, returns only pytrees of arrays (and Python "
            f"values). Register {type(value).__qualname__} as a pytree (flax.struct.dataclass, "
            "jax.tree_util.register_dataclass) or return its arrays.")


def _is_output_array(x) -> bool:
    # What a traced program can output; numpy scalars are Python values, handed back as they are.
    return isinstance(x, (jax.Array, np.ndarray))


def _structure(state: nnx_state.State) -> list:
    return [(id(s.owner), s.attribute) for s in state.slots] + [id(n) for n in state.nodes]


def _lift_closure_arrays(user, call: boundary.Call) -> tuple[tuple, tuple, bool]:
    """Which consts of the traced program are closed-over arrays the call can pass afresh.

    Returns (indices into the call's reached arrays, the const slots they fill, cacheable). With
    `jax_use_simplified_jaxpr_constants` a closed-over array is an array literal of the program
    instead of a const (its slot is then None): the interpreter substitutes it where it is read.
    Any other const or literal (an array behind a library object, one made while tracing) is
    baked into the program, which `Trace.key` then keys by its value or identity; a tracer
    cannot be baked: the program is not cached.
    """
    found = {id(a): k for k, a in enumerate(call.reach.arrays)}
    lifted, slots, cacheable = [], [], True
    literals = {id(v): v for v in jx.array_literals(equations(user))}
    for slot, value in [*enumerate(user.consts), *((None, v) for v in literals.values())]:
        k = found.get(id(value))
        if k is not None:
            lifted.append(k)
            slots.append(slot)
        elif jx.is_tracer(value):
            cacheable = False
    return tuple(lifted), tuple(slots), cacheable


class _Identity:
    """A key for an object by identity, holding it (so that its id stays its own)."""

    __slots__ = ("obj",)

    def __init__(self, obj):
        self.obj = obj

    def __hash__(self):
        return id(self.obj)

    def __eq__(self, other):
        return isinstance(other, _Identity) and other.obj is self.obj


class _Fingerprint:
    """A traced jaxpr as a hashable value, equal for two traces that autocast would transform
    into the same program: the equations (primitive, operands, parameters, result types), the
    scopes and contexts they were traced in (regions and module rules read them), and for
    function rules their Python stack; literals and baked constants by value (large ones by
    identity); the closed-over arrays the program takes as inputs by where the call found them.

    Args:
      arrays: the id of each array the call reached -> its index among them.
      with_code: whether the code objects of each equation's stack are part of it.
    """

    def __init__(self, arrays: dict[int, int], with_code: bool):
        self.arrays = arrays
        self.with_code = with_code
        self.memo: dict[int, tuple] = {}  # a sub-jaxpr used twice is keyed once

    def closed(self, closed) -> tuple:
        return self.jaxpr(closed.jaxpr), tuple(map(self.value, closed.consts))

    def jaxpr(self, jaxpr) -> tuple:
        key = self.memo.get(id(jaxpr))
        if key is None:
            key = self.memo[id(jaxpr)] = self._jaxpr(jaxpr)
        return key

    def _jaxpr(self, jaxpr) -> tuple:
        names: dict = {}

        def read(v):
            if isinstance(v, jex_core.Literal):
                return ("literal", self.value(v.val))
            return names[v]

        def define(variables) -> tuple:
            for v in variables:
                names[v] = len(names)
            return tuple(v.aval for v in variables)

        head = (define(jaxpr.constvars), define(jaxpr.invars))
        equations = tuple(
            (eqn.primitive, tuple(map(read, eqn.invars)),
             tuple((name, self.param(p)) for name, p in eqn.params.items()),
             define(eqn.outvars), jx.name_stack(eqn), getattr(eqn, "ctx", None),
             frozenset(eqn.effects), jx.traceback_code(eqn) if self.with_code else ())
            for eqn in jaxpr.eqns)
        return head, equations, tuple(map(read, jaxpr.outvars)), frozenset(jaxpr.effects)

    def param(self, p) -> Any:
        if isinstance(p, jex_core.ClosedJaxpr):
            return self.closed(p)
        if isinstance(p, jex_core.Jaxpr):
            return self.jaxpr(p)
        if type(p) in (tuple, list):
            return tuple(map(self.param, p))
        try:
            hash(p)
        except TypeError:
            return _Identity(p)
        return p  # functions (a custom_jvp's rule) by their own equality, as jax.jit keys them

    def value(self, x) -> Any:
        k = self.arrays.get(id(x))
        if k is not None:
            return ("input", k)
        if jx.is_tracer(x):
            return _Identity(x)
        if isinstance(x, (jax.Array, np.ndarray)):
            if x.size > boundary.NUMPY_CONTENT_CHECK:
                return _Identity(x)
            try:
                data = np.asarray(x).tobytes()
            except (TypeError, ValueError):  # PRNG keys and other extended dtypes
                return _Identity(x)
            return (type(x), x.dtype, x.shape, getattr(x, "weak_type", None),
                    getattr(x, "sharding", None), data)
        try:
            hash(x)
        except TypeError:
            return _Identity(x)
        return _typed(x)


def _typed(x) -> tuple:
    """A hashable Python value as a key that tells apart what `==` does not: 1, 1.0 and True
    must not share a program, nor 0.0 and -0.0; floats go by their bits, so a NaN equals
    itself."""
    if isinstance(x, (float, complex, np.inexact)):
        return type(x), np.asarray(x).tobytes()
    return type(x), x


def _typed_sources(sources) -> tuple:
    """`Source`s as a key: the Python values handed back by `_typed` (a cached program hands
    back the values of the trace that built it)."""
    return tuple(("value", _typed(s[1])) if s[0] == "value" else s for s in sources)


def _guards(call: boundary.Call) -> list[Callable[[boundary.Call], bool]]:
    guards = []
    for k, obj in enumerate(call.reach.identified):
        guards.append(_same_object(lambda c, k=k: c.reach.identified[k], obj))
    for k, array in enumerate(call.reach.numpy):
        guards.append(_same_object(lambda c, k=k: c.reach.numpy[k], array))
        if array.size <= boundary.NUMPY_CONTENT_CHECK:
            guards.append(_same_values(lambda c, k=k: c.reach.numpy[k], np.array(array)))
    return guards


def _same_object(get: Callable, obj: Any) -> Callable[[boundary.Call], bool]:
    # A weak reference where the object takes one, so that the cache keeps nothing alive
    # (a dead object's id may be reused: the check then fails).
    try:
        ref = weakref.ref(obj)
    except TypeError:
        return lambda call: get(call) is obj
    return lambda call: get(call) is ref()


def _same_values(get: Callable, copy: np.ndarray) -> Callable[[boundary.Call], bool]:
    # NaNs where the traced call's array had them count as the same values.
    return lambda call: np.array_equal(get(call), copy, equal_nan=copy.dtype.kind in "fc")


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


def cache_for(fn) -> _LRU:
    """The program cache of a user function."""
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
    # The class's own __call__ (a function), not a test of callability.
    call = getattr(type(fn), "__call__", None)  # noqa: B004
    if not inspect.isfunction(fn) and inspect.isfunction(call):
        return call
    return fn


__all__ = ["cache_for", "Program", "Source", "Trace"]
