"""The boundary of an autocast function: what one call reads, and what the traced program
depends on.

A call is taken apart into
- traced arrays: the array leaves of the arguments (any pytree of jax or numpy arrays);
- everything else the function can read: the other leaves of its arguments, and what it reaches
  from outside them (closure cells, the globals it names, defaults, `functools.partial`
  arguments, a bound method's object, the attributes of objects defined in user code, the
  closures of user functions these lead to, a few levels deep). This walk finds
  - NNX modules and Variables: their state (`_nnx_internals.State`) is traced too, borrowed
    while the function runs, and the values it leaves are written back;
  - jax arrays: those the traced program uses become its inputs, read afresh on every call;
  - numpy arrays and other objects, keyed by identity.

The function is traced on every call (`programs.Trace`), which reads its Python values (scalars,
strings, an object's fields) afresh. `Call.key` says what the traced program alone does not: the
types of the inputs, where the call found its arrays and NNX state, the objects it found.
What the key cannot say (the contents of numpy arrays) the program checks with `guards`.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import sys
import types
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jamp import _jax_internals as jx
from jamp.transforms import _nnx_internals as nnx_state

# Objects of these packages hold no user state: their attributes are not walked. Functions of
# the standard library are not walked either (its objects are: a SimpleNamespace or an
# argparse.Namespace holds a user's arrays).
_LIBRARIES = frozenset({"jax", "jaxlib", "flax", "optax", "chex", "numpy", "jamp", "scipy",
                        "ml_dtypes", "equinox", "torch"})
_STDLIB = frozenset(getattr(sys, "stdlib_module_names", ())) | {"functools", "typing"}
_MAX_DEPTH = 4  # functions and objects followed from the transformed function
_SCALARS = (bool, int, float, complex, str, bytes, type(None), np.generic)
# numpy arrays up to this size are also compared by content on every call.
NUMPY_CONTENT_CHECK = 1 << 16


def is_array(x) -> bool:
    """Array arguments are traced: jax arrays (and tracers), numpy arrays and numpy scalars."""
    return isinstance(x, (jax.Array, np.ndarray, np.generic))


def is_immutable(x) -> bool:
    """Values a program can hand out again on every call: scalars, strings, None."""
    return isinstance(x, _SCALARS)


@dataclasses.dataclass
class Reach:
    """What a call can read besides its traced arrays.

    Attributes:
      arrays: jax arrays (or tracers of an enclosing transform) found, each once.
      numpy: numpy arrays found, each once.
      roots: NNX modules and Variables found, each once, with the name they were found under.
      key: how the rest was found: objects by identity, and where each array and root sits
        (so that two names bound to one array are told from two arrays).
      identified: the objects keyed by identity (their id), in order: a program checks they
        are the same objects, since a dead object's id can be reused.
    """

    arrays: list = dataclasses.field(default_factory=list)
    numpy: list = dataclasses.field(default_factory=list)
    roots: list = dataclasses.field(default_factory=list)
    key: list = dataclasses.field(default_factory=list)
    identified: list = dataclasses.field(default_factory=list)
    _index: dict = dataclasses.field(default_factory=dict)
    _seen: set = dataclasses.field(default_factory=set)

    def visit(self, name: str, value: Any, depth: int = 0, in_object: bool = False) -> None:
        """Records `value` (found under `name`) and what it leads to.

        Python values (scalars, strings, the structure of a list) are not recorded: the trace
        of every call reads them, and the traced program says whether they changed it, so that
        a counter the function does not compute with does not transform it again at every
        step. Inside an object's attributes (`in_object`) only arrays and NNX objects are
        recorded.
        """
        if isinstance(value, (types.ModuleType, type)):
            if not in_object:
                self.key.append(("object", value))
        elif nnx_state.is_node(value):
            self.key.append(("nnx", self._add(self.roots, value, (name, value))))
        elif _is_scalar_array(value) and not in_object:
            # A closed-over scalar array is a constant of the program, like a Python scalar:
            # baked in (read with float() or `if`, or as a mask's fill, it must stay known),
            # so keyed by value with the traced program (`programs.Trace.key`).
            return
        elif isinstance(value, jax.Array):
            self.key.append(("array", self._add(self.arrays, value)))
        elif isinstance(value, np.ndarray):
            self.key.append(("numpy", self._add(self.numpy, value)))
        elif is_immutable(value):
            return
        elif _is_function_like(value):
            if not in_object:
                self.key.append(("function", self._code_of(value)))
                self.visit_function(name, value, depth + 1)
        else:
            leaves = jax.tree_util.tree_leaves(value, is_leaf=nnx_state.is_node)
            if len(leaves) == 1 and leaves[0] is value:
                self.visit_object(name, value, depth, in_object)
            else:
                for i, leaf in enumerate(leaves):
                    self.visit(f"{name}[{i}]", leaf, depth, in_object)

    def visit_function(self, name: str, fn: Callable, depth: int) -> None:
        """Walks what a function reads from outside its arguments."""
        if id(fn) in self._seen or depth > _MAX_DEPTH:
            return
        self._seen.add(id(fn))
        for sub_name, value in _function_reach(fn):
            self.visit(f"{name}.{sub_name}" if name else sub_name, value, depth)

    def visit_object(self, name: str, obj: Any, depth: int, in_object: bool = False) -> None:
        # An object: keyed by identity; one of user code is walked into for the arrays and
        # NNX modules it holds (what its methods read), one of a library is not.
        if not in_object:
            self.key.append(("id", id(obj)))
            self.identified.append(obj)
        if (id(obj) in self._seen or depth >= _MAX_DEPTH
                or _is_library(type(obj), stdlib=False)):
            return
        self._seen.add(id(obj))
        for attr, value in sorted(getattr(obj, "__dict__", {}).items()):
            self.visit(f"{name}.{attr}", value, depth + 1, in_object=True)

    def _code_of(self, fn) -> Any:
        # A function by its code (a lambda built again each step is the same function); a
        # callable without code by identity.
        while isinstance(fn, functools.partial):
            fn = fn.func
        code = getattr(getattr(fn, "__func__", fn), "__code__", None)
        if code is not None:
            return code
        self.identified.append(fn)
        return ("id", id(fn))

    def _add(self, items: list, value: Any, entry: Any = None) -> int:
        # The index of `value` among `items`, adding it once.
        key = (id(items), id(value))
        if key not in self._index:
            self._index[key] = len(items)
            items.append(value if entry is None else entry)
        return self._index[key]


def _is_scalar_array(x) -> bool:
    return (isinstance(x, jax.Array) and not jx.is_tracer(x) and x.ndim == 0
            and (jnp.issubdtype(x.dtype, jnp.number) or x.dtype == jnp.bool_))


def _static_key(x) -> Any:
    # By value, with the type: 1 == 1.0 == True must not share a program.
    return (type(x), x)


def _is_function_like(x) -> bool:
    return (inspect.isfunction(x) or inspect.ismethod(x) or isinstance(x, functools.partial)
            or hasattr(x, "__wrapped__"))


def _function_reach(fn) -> list[tuple[str, Any]]:
    """(name, value) for what a callable reads besides its arguments."""
    found = []
    if isinstance(fn, functools.partial):
        found += [(f"partial.args[{i}]", v) for i, v in enumerate(fn.args)]
        found += [(f"partial.{k}", v) for k, v in fn.keywords.items()]
        return found + [("partial.func", fn.func)]
    if inspect.ismethod(fn):
        return [("self", fn.__self__), ("function", fn.__func__)]
    if not inspect.isfunction(fn):
        wrapped = getattr(fn, "__wrapped__", None)  # functools.wraps, jax.vmap, ...
        if wrapped is not None:
            found.append(("wrapped", wrapped))
        for attr in ("fun", "fwd", "bwd", "jvp"):  # jax.custom_jvp / custom_vjp objects
            value = getattr(fn, attr, None)
            if inspect.isfunction(value):
                found.append((attr, value))
        if not found:  # a callable object: the object and its __call__
            found.append(("self", fn))
            # The class's own __call__ (a function), not a test of callability.
            call = getattr(type(fn), "__call__", None)  # noqa: B004
            if inspect.isfunction(call):
                found.append(("__call__", call))
        return found
    if _is_library(fn):
        return found
    if hasattr(fn, "__wrapped__"):
        found.append(("wrapped", fn.__wrapped__))
    code = fn.__code__
    for name, cell in zip(code.co_freevars, fn.__closure__ or (), strict=True):
        try:
            found.append((name, cell.cell_contents))
        except ValueError:  # an empty cell: a name not bound yet
            continue
    names = dict.fromkeys(_global_names(code))
    found += [(name, fn.__globals__[name]) for name in names if name in fn.__globals__]
    found += [(f"defaults[{i}]", v) for i, v in enumerate(fn.__defaults__ or ())]
    found += list((fn.__kwdefaults__ or {}).items())
    return found


def _global_names(code: types.CodeType):
    yield from code.co_names
    for const in code.co_consts:  # lambdas, comprehensions and nested functions inside
        if isinstance(const, types.CodeType):
            yield from _global_names(const)


def _is_library(obj, stdlib: bool = True) -> bool:
    package = (getattr(obj, "__module__", None) or "").partition(".")[0]
    return package in _LIBRARIES or (stdlib and package in _STDLIB)


@dataclasses.dataclass
class Call:
    """One call of a transformed function, taken apart (see the module docstring).

    Attributes:
      leaves / in_tree: the arguments' leaves, NNX objects kept whole.
      traced: indices of the array leaves.
      reach: what the call can read besides them.
      state: the NNX state of the modules it reaches.
      state_leaves / state_tree: the state's values, flattened; `state_traced` indexes their
        array leaves (traced), the others are Python values (part of the key).
      key: what a traced program depends on (hashable), or None when something it depends on
        cannot be told apart from call to call (the program is then traced every time).
    """

    fn: Callable
    leaves: list
    in_tree: Any
    traced: list[int]
    reach: Reach
    state: nnx_state.State
    state_leaves: list
    state_tree: Any
    state_traced: list[int]
    key: tuple | None

    @classmethod
    def of(cls, fn: Callable, args: tuple, kwargs: dict) -> "Call":
        leaves, in_tree = jax.tree_util.tree_flatten((args, kwargs), is_leaf=nnx_state.is_node)
        traced = [i for i, x in enumerate(leaves) if is_array(x)]
        reach = Reach()
        static = [i for i, x in enumerate(leaves) if not is_array(x)]
        if static:
            leaf_names = argument_names(fn, in_tree)
            for i in static:
                reach.visit(leaf_names[i], leaves[i])
        reach.visit_function("", fn, 0)
        state = nnx_state.State.of(reach.roots)
        state_leaves, state_tree = jax.tree_util.tree_flatten(state.values())
        state_traced = [i for i, x in enumerate(state_leaves) if is_array(x)]
        key: tuple | None = (
            in_tree, tuple(reach.key), state_tree, state.structure(),
            tuple(_aval_key(leaves[i]) for i in traced),
            tuple(_aval_key(x) if is_array(x) else _static_key(x) for x in state_leaves),
            tuple(_aval_key(a) for a in reach.arrays),
            tuple((a.shape, a.dtype) for a in reach.numpy),
            jx.trace_context())
        try:
            hash(key)
        except TypeError:  # a module's static attribute or a state value that cannot be hashed
            key = None
        return cls(fn, leaves, in_tree, traced, reach, state, state_leaves, state_tree,
                   state_traced, key)

    @functools.cached_property
    def names(self) -> tuple[str, ...]:
        """A name for each traced input, for errors raised while tracing (computed then)."""
        leaf_names = argument_names(self.fn, self.in_tree)
        return (tuple(leaf_names[i] for i in self.traced)
                + _state_names(self.state))

    @property
    def inputs(self) -> list:
        """The traced arrays, then the array leaves of the NNX state."""
        return ([self.leaves[i] for i in self.traced]
                + [self.state_leaves[i] for i in self.state_traced])

    def arguments(self, arrays: Sequence[Any]) -> tuple[tuple, dict]:
        """The call's (args, kwargs) with the traced arrays replaced by `arrays`."""
        full = list(self.leaves)
        for i, a in zip(self.traced, arrays, strict=True):
            full[i] = a
        return jax.tree_util.tree_unflatten(self.in_tree, full)

    def slot_sources(self, index: int) -> list:
        """Where each leaf of the NNX slot `index` comes from when nothing changed it: the
        call's traced inputs, or its Python value."""
        start, stop = self._slot_ranges[index]
        return [("in", self._input_position[i]) if is_array(self.state_leaves[i])
                else ("value", self.state_leaves[i]) for i in range(start, stop)]

    @functools.cached_property
    def _input_position(self) -> dict[int, int]:
        # state leaf -> its position among `inputs`
        return {leaf: len(self.traced) + k for k, leaf in enumerate(self.state_traced)}

    @functools.cached_property
    def _slot_ranges(self) -> list[tuple[int, int]]:
        ranges, start = [], 0
        for value in self.state.values():
            stop = start + len(jax.tree_util.tree_leaves(value))
            ranges.append((start, stop))
            start = stop
        return ranges

    def state_values(self, arrays: Sequence[Any]) -> list:
        """The NNX state's values with its array leaves replaced by `arrays`."""
        full = list(self.state_leaves)
        for i, a in zip(self.state_traced, arrays, strict=True):
            full[i] = a
        return jax.tree_util.tree_unflatten(self.state_tree, full)


def _state_names(state: nnx_state.State) -> tuple[str, ...]:
    names = []
    for slot in state.slots:
        value_leaves = jax.tree_util.tree_leaves(slot.get())
        names += [slot.name if len(value_leaves) == 1 else f"{slot.name}[{j}]"
                  for j, leaf in enumerate(value_leaves) if is_array(leaf)]
    return tuple(names)


def _aval_key(x) -> tuple:
    aval = jax.typeof(x)
    return (tuple(aval.shape), aval.dtype, bool(getattr(aval, "weak_type", False)),
            getattr(aval, "sharding", None), getattr(aval, "manual_axis_type", None))


def argument_names(fn: Callable, in_tree) -> list[str]:
    """A name for each leaf of a call's `(args, kwargs)`, as `jax.jit` writes them in errors:
    `params['w']`, `batch['x']`, `args[2]` for `*args`, `kw['d']` for `**kw`."""
    try:
        parameters = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        parameters = []
    positional = [p.name for p in parameters
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    varargs = next((p.name for p in parameters if p.kind == p.VAR_POSITIONAL), "args")
    named = {p.name for p in parameters if p.kind != p.VAR_KEYWORD}
    varkw = next((p.name for p in parameters if p.kind == p.VAR_KEYWORD), None)
    example = jax.tree_util.tree_unflatten(in_tree, list(range(in_tree.num_leaves)))
    names = [""] * in_tree.num_leaves
    for path, leaf in jax.tree_util.tree_flatten_with_path(example)[0]:
        where, first, *inner = path
        rest = jax.tree_util.keystr(tuple(inner))
        if where.idx == 0:  # positional
            k = first.idx
            head = positional[k] if k < len(positional) else f"{varargs}[{k - len(positional)}]"
        else:
            head = first.key if first.key in named or varkw is None else f"{varkw}['{first.key}']"
        names[leaf] = head + rest
    return names


__all__ = ["argument_names", "Call", "is_array", "is_immutable", "NUMPY_CONTENT_CHECK", "Reach"]
