"""Every touch of Flax NNX internals that autocast needs, in one place.

An autocast function traces the user's function in a JAX trace of its own. NNX ties each
Variable and each module to the trace it was created in and refuses to update them, or to hand
them to `nnx.scan`/`nnx.vmap`, from any other trace. NNX's own transforms only take modules as
arguments, and rebuild them inside (`nnx.split`/`nnx.merge`); autocast must also serve the
modules a function closes over, and must leave the caller's objects holding the new state. So
while the function is traced, autocast *borrows* the modules it reaches: their Variables hold
the trace's values and they are valid in the trace; afterwards everything is put back, and the
updated values are written into the caller's Variables at the caller's trace level.

What is touched, all of it restored on exit: `Variable._raw_value` and `Variable._trace_state`,
and the `_trace_state` of each module's `_pytree__state`. Supported: flax 0.12.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterable, Iterator, Sequence

import jax
import numpy as np
from flax import nnx
from flax.nnx import graph as _graph
from flax.nnx import tracers as _tracers


def is_node(x: Any) -> bool:
    """True for NNX objects: modules (and other graph nodes) and Variables."""
    return isinstance(x, nnx.Variable) or _graph.is_graph_node(x)


def _is_borrowable(variable: nnx.Variable) -> bool:
    # Variables backed by JAX refs (`hijax`) may already be updated from any trace; Variables
    # holding Python objects rather than arrays have nothing to trace.
    metadata = variable.get_metadata()
    if metadata.get("hijax") or metadata.get("ref"):
        return False
    return isinstance(variable.get_raw_value(), (jax.Array, np.ndarray))


def reachable(roots: Iterable[tuple[str, Any]]) -> tuple[list, list, list[str]]:
    """The array Variables and the other graph nodes reachable from the named `roots`, each
    once, in NNX's traversal order; and a name for each Variable (`model.bn.mean`)."""
    variables: dict[int, nnx.Variable] = {}
    names: dict[int, str] = {}
    nodes: dict[int, Any] = {}
    for root_name, root in roots:
        for path, value in nnx.iter_graph(root):
            if isinstance(value, nnx.Variable):
                if _is_borrowable(value) and id(value) not in variables:
                    variables[id(value)] = value
                    names[id(value)] = ".".join([root_name, *map(str, path)])
            elif _graph.is_graph_node(value) and hasattr(value, "_pytree__state"):
                nodes.setdefault(id(value), value)
    return list(variables.values()), list(nodes.values()), list(names.values())


def structure(root: Any) -> Any:
    """A hashable description of a node's structure: its graphdef (modules' static attributes
    such as `deterministic` included), or a Variable's type."""
    if isinstance(root, nnx.Variable):
        return type(root)
    return nnx.graphdef(root)


def value(variable: nnx.Variable) -> Any:
    return variable.get_raw_value()


@contextlib.contextmanager
def borrowed(variables: Sequence[nnx.Variable], values: Sequence[Any],
             nodes: Sequence[Any]) -> Iterator[None]:
    """Within the block, `variables` hold `values` and every variable and node is valid in the
    current trace; on exit both are restored."""
    saved_values = [v.get_raw_value() for v in variables]
    saved_traces = [v._trace_state for v in variables]
    saved_node_traces = [n._pytree__state._trace_state for n in nodes]
    try:
        for variable, new in zip(variables, values):
            object.__setattr__(variable, "_raw_value", new)
            object.__setattr__(variable, "_trace_state", _tracers.TraceState())
        for node in nodes:
            object.__setattr__(node._pytree__state, "_trace_state", _tracers.TraceState())
        yield
    finally:
        for variable, old, trace in zip(variables, saved_values, saved_traces):
            object.__setattr__(variable, "_raw_value", old)
            object.__setattr__(variable, "_trace_state", trace)
        for node, trace in zip(nodes, saved_node_traces):
            object.__setattr__(node._pytree__state, "_trace_state", trace)


def write_back(variable: nnx.Variable, new: Any) -> None:
    """Sets a Variable's value at the caller's trace level (NNX checks that it may)."""
    variable.set_raw_value(new)
