"""The boundary of an autocast function: what one call passes in and gets back.

A call is taken apart into
- traced arrays: the array leaves of the arguments (any pytree of jax or numpy arrays);
- static leaves: every other leaf of the arguments (Python numbers, strings, flags), passed to
  the function as they are;
- NNX state: the array Variables of the NNX modules among the arguments and in the function's
  closure, borrowed while the function is traced (`_nnx_internals`) so that its updates
  (BatchNorm statistics, Dropout's RNG counts) come back out and are written into the caller's
  modules;
- the closure: what the function reads from outside its arguments (closure cells, the globals
  it names, defaults, `functools.partial` arguments, a bound method's object), found by
  walking Python's function objects. Arrays found there become inputs of the transformed
  program, read afresh on every call; Python scalars, strings and object identities are part
  of the cache key, as static arguments are for `jax.jit`.

`Call.key` says everything the traced program depends on, so that `autocast` can serve a
repeated call from its cache without tracing the function again.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import sys
import types
from typing import Any, Callable, Iterator, Sequence

import jax
import numpy as np

from jamp.transforms import _jax_internals as jx
from jamp.transforms import _nnx_internals as nnx_state

# Functions of these packages are not user code: their closures are not walked.
_LIBRARIES = frozenset({"jax", "jaxlib", "flax", "optax", "chex", "numpy", "jamp", "scipy",
                        "ml_dtypes", "equinox", "torch", "functools", "typing"}) | frozenset(
    getattr(sys, "stdlib_module_names", ()))
_MAX_DEPTH = 4  # nested user functions followed from the transformed one
_SCALARS = (bool, int, float, complex, str, bytes, type(None), np.generic)


def is_array(x) -> bool:
    """Array arguments are traced: jax arrays (and tracers), numpy arrays and numpy scalars."""
    return isinstance(x, (jax.Array, np.ndarray, np.generic))


def _static_key(x) -> Any:
    # Hashable values by value (with their type: 1 == 1.0 == True), others by identity.
    try:
        hash(x)
    except TypeError:
        return ("id", id(x))
    return (type(x), x)


@dataclasses.dataclass
class Closure:
    """What a function reads from outside its arguments.

    Attributes:
      arrays: jax arrays (or tracers of an enclosing transform) found in it.
      nodes: NNX modules and Variables found in it, with the name they were found under.
      key: everything else that was found: scalars by value, objects by identity.
      keep: the objects keyed by identity, held so that their ids stay theirs.
    """

    arrays: list = dataclasses.field(default_factory=list)
    nodes: list = dataclasses.field(default_factory=list)
    key: list = dataclasses.field(default_factory=list)
    keep: list = dataclasses.field(default_factory=list)


def closure_of(fn: Callable) -> Closure:
    """Walks `fn`'s closure, globals, defaults and bound objects (user functions it reaches
    too, a few levels deep)."""
    found = Closure()
    seen: set[int] = set()
    for name, value, depth in _roots(fn, 0, seen):
        _visit(found, name, value, depth, seen)
    return found


def _roots(fn, depth: int, seen: set) -> Iterator[tuple[str, Any, int]]:
    if id(fn) in seen or depth > _MAX_DEPTH:
        return
    seen.add(id(fn))
    if isinstance(fn, functools.partial):
        for i, value in enumerate(fn.args):
            yield f"partial.args[{i}]", value, depth
        for key, value in fn.keywords.items():
            yield f"partial.{key}", value, depth
        yield from _roots(fn.func, depth, seen)
        return
    if inspect.ismethod(fn):
        yield "self", fn.__self__, depth
        fn = fn.__func__
    elif not inspect.isfunction(fn):
        # A callable object (an NNX module, a class with __call__): the object and its method.
        yield "self", fn, depth
        call = getattr(type(fn), "__call__", None)
        if inspect.isfunction(call):
            yield from _roots(call, depth, seen)
        return
    if _is_library(fn):
        return
    code = fn.__code__
    for name, cell in zip(code.co_freevars, fn.__closure__ or ()):
        try:
            yield name, cell.cell_contents, depth
        except ValueError:  # an empty cell: a name not bound yet
            continue
    for name in _global_names(code):
        if name in fn.__globals__:
            yield name, fn.__globals__[name], depth
    for i, value in enumerate(fn.__defaults__ or ()):
        yield f"defaults[{i}]", value, depth
    for key, value in (fn.__kwdefaults__ or {}).items():
        yield key, value, depth


def _global_names(code: types.CodeType) -> Iterator[str]:
    yield from code.co_names
    for const in code.co_consts:  # lambdas, comprehensions and nested functions inside
        if isinstance(const, types.CodeType):
            yield from _global_names(const)


def _is_library(fn) -> bool:
    module = getattr(fn, "__module__", None) or ""
    return module.partition(".")[0] in _LIBRARIES


def _visit(found: Closure, name: str, value: Any, depth: int, seen: set) -> None:
    if isinstance(value, (types.ModuleType, type)):
        return
    if nnx_state.is_node(value):
        found.nodes.append((name, value))
        found.key.append(("nnx", len(found.nodes)))
    elif isinstance(value, jax.Array):
        found.arrays.append(value)
        found.key.append(("array", len(found.arrays)))
    elif isinstance(value, _SCALARS):
        found.key.append(_static_key(value))
    elif isinstance(value, np.ndarray):
        found.key.append(("numpy", id(value)))
        found.keep.append(value)
    elif callable(value) and (inspect.isfunction(value) or inspect.ismethod(value)
                              or isinstance(value, functools.partial)):
        if inspect.ismethod(value) and not _is_library(value):
            _visit_attributes(found, name, value.__self__, depth, seen)
        for sub_name, sub, sub_depth in _roots(value, depth + 1, seen):
            _visit(found, f"{name}.{sub_name}", sub, sub_depth, seen)
    else:
        leaves, tree = jax.tree_util.tree_flatten(value, is_leaf=nnx_state.is_node)
        if len(leaves) == 1 and leaves[0] is value:
            # Not a container: an object, keyed by identity (its attributes are not read).
            found.key.append(("id", id(value)))
            found.keep.append(value)
            if depth == 0 and name == "self":
                _visit_attributes(found, name, value, depth, seen)
            return
        found.key.append(("tree", tree))
        for i, leaf in enumerate(leaves):
            _visit(found, f"{name}[{i}]", leaf, depth, seen)


def _visit_attributes(found: Closure, name: str, obj: Any, depth: int, seen: set) -> None:
    # A bound method's object: what its method reads from `self`.
    if id(obj) in seen or nnx_state.is_node(obj):
        return
    seen.add(id(obj))
    for attr, value in sorted(getattr(obj, "__dict__", {}).items()):
        _visit(found, f"{name}.{attr}", value, depth + 1, seen)


@dataclasses.dataclass
class Call:
    """One call of a transformed function, taken apart (see the module docstring).

    Attributes:
      leaves / in_tree: the arguments' leaves, NNX objects kept whole.
      traced: indices of the array leaves.
      closure: what the function reads from outside its arguments.
      variables / nodes: the NNX state borrowed while tracing (from the arguments' and the
        closure's NNX objects).
      variable_names: a name for each variable, for error messages.
      key: what the traced program depends on (hashable).
    """

    leaves: list
    in_tree: Any
    traced: list[int]
    closure: Closure
    variables: list
    nodes: list
    variable_names: list[str]
    key: tuple

    @classmethod
    def of(cls, fn: Callable, args: tuple, kwargs: dict) -> "Call":
        leaves, in_tree = jax.tree_util.tree_flatten((args, kwargs), is_leaf=nnx_state.is_node)
        traced = [i for i, x in enumerate(leaves) if is_array(x)]
        closure = closure_of(fn)
        roots = [(f"args{_leaf_path(in_tree, i)}", x) for i, x in enumerate(leaves)
                 if nnx_state.is_node(x)] + closure.nodes
        variables, nodes, names = nnx_state.reachable(roots)
        static = tuple(("array",) if i in set(traced) else _static_key(x)
                       for i, x in enumerate(leaves) if not nnx_state.is_node(x))
        key = (in_tree, static,
               tuple(_aval_key(leaves[i]) for i in traced),
               tuple(nnx_state.structure(root) for _, root in roots),
               tuple(_aval_key(nnx_state.value(v)) for v in variables),
               tuple(closure.key), tuple(_aval_key(a) for a in closure.arrays),
               jx.trace_context())
        return cls(leaves, in_tree, traced, closure, variables, nodes, names, key)

    @property
    def inputs(self) -> list:
        """The traced arrays, then the NNX variables' values."""
        return ([self.leaves[i] for i in self.traced]
                + [nnx_state.value(v) for v in self.variables])

    def arguments(self, arrays: Sequence[Any]) -> tuple[tuple, dict]:
        """The call's (args, kwargs) with the traced arrays replaced by `arrays`."""
        full = list(self.leaves)
        for i, a in zip(self.traced, arrays):
            full[i] = a
        return jax.tree_util.tree_unflatten(self.in_tree, full)

    def is_borrowed(self, x) -> bool:
        """True for the NNX objects of the arguments and the closure (returned as they are)."""
        return nnx_state.is_node(x) and (
            any(x is leaf for leaf in self.leaves)
            or any(x is node for _, node in self.closure.nodes))


def _aval_key(x) -> tuple:
    aval = jx.typeof(x)
    return (tuple(aval.shape), aval.dtype, bool(getattr(aval, "weak_type", False)),
            getattr(aval, "sharding", None), getattr(aval, "manual_axis_type", None))


def _leaf_path(in_tree, index: int) -> str:
    paths = jax.tree_util.tree_flatten_with_path(
        jax.tree_util.tree_unflatten(in_tree, list(range(in_tree.num_leaves))))[0]
    return jax.tree_util.keystr(paths[index][0])


def arg_names(fn: Callable, call: Call) -> tuple[str, ...]:
    """Names of the traced inputs as `jax.jit` writes them (`params['w']`, `batch['x']`), then
    of the NNX variables: what errors raised while tracing point at."""
    try:
        parameters = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        parameters = []
    positional = [p.name for p in parameters
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    varargs = next((p.name for p in parameters if p.kind == p.VAR_POSITIONAL), "args")
    example = jax.tree_util.tree_unflatten(call.in_tree, list(range(len(call.leaves))))
    paths = {leaf: path for path, leaf in jax.tree_util.tree_flatten_with_path(example)[0]}
    names = []
    for i in call.traced:
        (where, *rest) = paths[i]
        first, *inner = rest
        inner_text = jax.tree_util.keystr(tuple(inner))
        if where.idx == 0:  # positional
            k = first.idx
            names.append((positional[k] if k < len(positional)
                          else f"{varargs}[{k - len(positional)}]") + inner_text)
        else:
            names.append(f"{first.key}{inner_text}")
    return tuple(names) + tuple(call.variable_names)
