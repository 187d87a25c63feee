"""Every touch of Flax NNX internals that autocast needs, in one place.

An autocast function traces the user's function in a JAX trace of its own. NNX ties each
Variable and each module to the trace it was created in and refuses to update them, or to hand
them to `nnx.scan`/`nnx.vmap`, from any other trace. NNX's own transforms only take modules as
arguments, and rebuild them inside (`nnx.split`/`nnx.merge`); autocast must also serve the
modules a function closes over, and must leave the caller's objects holding the new state. So
while the function is traced, autocast *borrows* the modules it reaches: their state holds the
trace's values and they are valid in the trace; afterwards everything is put back, and the
values the function left are written into the caller's objects at the caller's trace level.

State lives in *slots*: a Variable's raw value (an array, a pytree of arrays, a Python value),
or an array attribute of a module (`nnx.data`). What is touched, all of it restored on exit:
`Variable._raw_value` and `Variable._trace_state`, module array attributes, and the
`_trace_state` of each module's `_pytree__state`. Objects the function creates and attaches
(`sow`, a new `nnx.Cache`, a replaced Param) are made valid at the caller's level when their
values are written. Supported: flax 0.12.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Iterator, Sequence

import jax
import numpy as np
from flax import nnx
from flax.nnx import graph as _graph
from flax.nnx import tracers as _tracers


def is_node(x: Any) -> bool:
    """True for NNX objects: modules (and other graph nodes) and Variables."""
    return isinstance(x, nnx.Variable) or _graph.is_graph_node(x)


def _is_array(x) -> bool:
    return isinstance(x, (jax.Array, np.ndarray))


@dataclasses.dataclass(frozen=True)
class Slot:
    """A place NNX state lives: a Variable's raw value (`attribute` None), or an attribute of a
    module holding arrays (an array, or a container of them: `nnx.data`, `nnx.List` items)."""

    owner: Any
    attribute: str | None
    name: str

    def get(self) -> Any:
        if self.attribute is None:
            return self.owner.get_raw_value()
        return object.__getattribute__(self.owner, self.attribute)

    def swap(self, value: Any) -> None:
        """Sets the value without NNX's trace-level check (the owner is being borrowed)."""
        object.__setattr__(self.owner, "_raw_value" if self.attribute is None
                           else self.attribute, value)

    def write(self, value: Any) -> None:
        """Sets the value as user code would, so NNX refuses it where it would refuse the
        same update without autocast (a closed-over module updated inside `jax.grad`)."""
        if self.attribute is None:
            self.owner.set_raw_value(value)
        else:
            setattr(self.owner, self.attribute, value)


@dataclasses.dataclass
class State:
    """The NNX state reachable from some roots (modules, Variables)."""

    roots: list
    slots: list[Slot]
    nodes: list   # graph nodes (modules) and Variables, whose trace state is borrowed

    @classmethod
    def of(cls, roots: Sequence[tuple[str, Any]]) -> "State":
        slots: dict[tuple[int, str | None], Slot] = {}
        nodes: dict[int, Any] = {}
        for root_name, root in roots:
            owners: dict[tuple, Any] = {}
            arrays: list[tuple] = []
            for path, value in nnx.iter_graph(root):
                path = tuple(path)
                name = ".".join([root_name, *map(str, path)])
                if isinstance(value, nnx.Variable):
                    if _is_borrowable(value):
                        nodes.setdefault(id(value), value)
                        slots.setdefault((id(value), None), Slot(value, None, name))
                elif _graph.is_graph_node(value) and hasattr(value, "_pytree__state"):
                    nodes.setdefault(id(value), value)
                    owners[path] = value
                elif _is_array(value) and path:
                    arrays.append(path)
            for path in arrays:
                # The module holding the array, and the attribute it sits in (an array, or a
                # container of arrays; nnx.List keeps item i as attribute "i").
                depth = max(d for d in range(len(path)) if path[:d] in owners)
                owner, attribute = owners[path[:depth]], str(path[depth])
                slots.setdefault((id(owner), attribute), Slot(
                    owner, attribute, ".".join([root_name, *map(str, path[:depth + 1])])))
        return cls([root for _, root in roots], list(slots.values()), list(nodes.values()))

    def values(self) -> list:
        return [slot.get() for slot in self.slots]

    def structure(self) -> Any:
        """A description of the roots' structure, sharing between them and modules' static
        attributes (`deterministic`...) included; None when it cannot be hashed."""
        if not self.roots:
            return ()
        graphdef = nnx.graphdef(tuple(self.roots))
        try:
            hash(graphdef)
        except TypeError:
            return None
        return graphdef

    def objects(self) -> list:
        """The roots, modules and Variables, in a fixed order: what a returned NNX object is
        looked up in."""
        return list(self.roots) + list(self.nodes)


def _is_borrowable(variable: nnx.Variable) -> bool:
    # Variables backed by JAX refs (`hijax`) may already be updated from any trace.
    metadata = variable.get_metadata()
    return not (metadata.get("hijax") or metadata.get("ref"))


@contextlib.contextmanager
def borrowed(state: State, values: Sequence[Any]) -> Iterator[None]:
    """Within the block the state's slots hold `values` and its objects are valid in the
    current trace; on exit both are restored. If the block raises, the modules' attributes
    are restored too, so that objects the function attached before failing (holding the
    trace's values) do not stay on them."""
    saved = state.values()
    saved_traces = [_trace_state(node) for node in state.nodes]
    modules = [node for node in state.nodes if not isinstance(node, nnx.Variable)]
    saved_attributes = [dict(vars(node)) for node in modules]
    try:
        for slot, value in zip(state.slots, values, strict=True):
            slot.swap(value)
        for node in state.nodes:
            _set_trace_state(node, _tracers.TraceState())
        yield
    except BaseException:
        for node, attributes in zip(modules, saved_attributes, strict=True):
            for name in set(vars(node)) - set(attributes):
                object.__delattr__(node, name)
            for name, value in attributes.items():
                if vars(node).get(name) is not value:
                    object.__setattr__(node, name, value)
        raise
    finally:
        for slot, value in zip(state.slots, saved, strict=True):
            slot.swap(value)
        for node, trace in zip(state.nodes, saved_traces, strict=True):
            _set_trace_state(node, trace)


def adopt(nodes: Sequence[Any]) -> None:
    """Makes objects created during the trace (and attached to the caller's modules) valid
    at the current trace level, as if the caller had created them."""
    for node in nodes:
        _set_trace_state(node, _tracers.TraceState())


def _trace_state(node):
    if isinstance(node, nnx.Variable):
        return node._trace_state
    return node._pytree__state._trace_state


def _set_trace_state(node, trace) -> None:
    if isinstance(node, nnx.Variable):
        object.__setattr__(node, "_trace_state", trace)
    else:
        object.__setattr__(node._pytree__state, "_trace_state", trace)
