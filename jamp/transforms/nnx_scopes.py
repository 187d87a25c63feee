"""NNX module calls named by their graph path, as Flax linen names its modules' calls.

linen runs each module's methods inside a `jax.named_scope` of the module's name, so every
equation of a traced program says which module made it: precision rules match on it, and the
profiler and the AMP report attribute work by it. NNX opens no scope. Inside `named_calls(roots)`
the `__call__` of an NNX module runs inside named scopes that spell its graph path: the root by
its class name, then the attribute names and list indices NNX's graph gives (`Net/blocks/0/attn`),
each call below the scopes of the module that called it. autocast enters it while it traces a
function, for the NNX modules it reaches (arguments and closure); other code can enter it too.

A module that is not in the graph of its caller is named by its class, under its caller: the
layer `nnx.scan` or `nnx.vmap` hands to its body is such a module (NNX splits and merges the
stacked layers into a new object inside its transforms), and so is a module created inside the
traced function.

NNX modules are called through their class (`type(m).__call__`), so naming a call means wrapping
the `__call__` of the classes involved while the context is open (as `nnx.capture` does for the
methods it records): the wrapper names only the calls made in a context that knows the module's
path, from the thread that opened it, and the classes get their own `__call__` back when the
last context using them closes.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import threading
from typing import Any, Iterable, Iterator

import jax
from flax import nnx

_NAMING: contextvars.ContextVar["_Naming | None"] = contextvars.ContextVar(
    "jamp_nnx_naming", default=None)
_LOCK = threading.Lock()
# class -> [its own __call__, how many open contexts wrap it]
_WRAPPED: dict[type, list] = {}


@contextlib.contextmanager
def named_calls(roots: Iterable[Any]) -> Iterator[None]:
    """While open, calls of the NNX modules in the graphs of `roots` (other values are
    ignored) run inside named scopes spelling their graph path.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from flax import nnx
      >>> from jamp.transforms.nnx_scopes import named_calls
      >>> class Net(nnx.Module):
      ...     def __init__(self, rngs):
      ...         self.head = nnx.Linear(2, 2, rngs=rngs)
      ...     def __call__(self, x):
      ...         return self.head(x)
      >>> net = Net(nnx.Rngs(0))
      >>> with named_calls([net]):
      ...     jaxpr = jax.make_jaxpr(net)(jnp.ones((1, 2)))
      >>> str(jaxpr.jaxpr.eqns[0].source_info.name_stack)
      'Net/head'
    """
    modules = [r for r in roots if isinstance(r, nnx.Module)]
    if not modules:
        yield
        return
    naming = _Naming(modules)
    classes = {owner for m in naming.modules() if (owner := _call_owner(type(m))) is not None}
    _wrap(classes)
    token = _NAMING.set(naming)
    try:
        yield
    finally:
        _NAMING.reset(token)
        _unwrap(classes)


class _Naming:
    """The graph paths of the modules one context names, and the calls running."""

    def __init__(self, roots: list):
        self._paths: dict[int, tuple[Any, tuple[str, ...]]] = {}  # id -> (module, path)
        for root in roots:
            for path, module in nnx.iter_modules(root):
                self._paths.setdefault(id(module),
                                       (module, (type(root).__name__, *map(str, path))))
        self.calls: list[tuple[Any, tuple[str, ...]]] = []  # (module, path), innermost last

    def modules(self) -> list:
        return [module for module, _ in self._paths.values()]

    def path(self, module) -> tuple[str, ...]:
        known = self._paths.get(id(module))
        if known is not None and known[0] is module:
            return known[1]
        caller = self.calls[-1] if self.calls else None
        path = None
        if caller is not None:
            path = next((caller[1] + tuple(map(str, p)) for p, m in nnx.iter_modules(caller[0])
                         if m is module), None)
        if path is None:
            path = (*(caller[1] if caller else ()), type(module).__name__)
        self._paths[id(module)] = (module, path)  # the module kept alive: its id stays its own
        return path

    def scope_names(self, path: tuple[str, ...]) -> tuple[str, ...]:
        """The scopes a call at `path` opens below its caller's: the rest of its path where it
        lies inside the caller's, else all of it."""
        outer = self.calls[-1][1] if self.calls else ()
        if len(path) > len(outer) and path[:len(outer)] == outer:
            return path[len(outer):]
        return path


def _call_owner(cls: type) -> type | None:
    return next((c for c in cls.__mro__ if "__call__" in vars(c) and c is not object), None)


def _named(call):
    @functools.wraps(call)
    def __call__(self, *args, **kwargs):
        naming = _NAMING.get()
        # A module calling its own __call__ again (a subclass's calling super()'s) is one call.
        if naming is None or (naming.calls and naming.calls[-1][0] is self):
            return call(self, *args, **kwargs)
        path = naming.path(self)
        names = naming.scope_names(path)
        naming.calls.append((self, path))
        try:
            with contextlib.ExitStack() as scopes:
                for name in names:
                    scopes.enter_context(jax.named_scope(name))
                return call(self, *args, **kwargs)
        finally:
            naming.calls.pop()

    return __call__


def _wrap(classes: set[type]) -> None:
    with _LOCK:
        for cls in classes:
            entry = _WRAPPED.get(cls)
            if entry is None:
                own = vars(cls)["__call__"]
                _WRAPPED[cls] = [own, 1]
                type.__setattr__(cls, "__call__", _named(own))
            else:
                entry[1] += 1


def _unwrap(classes: set[type]) -> None:
    with _LOCK:
        for cls in classes:
            entry = _WRAPPED[cls]
            entry[1] -= 1
            if not entry[1]:
                type.__setattr__(cls, "__call__", entry[0])
                del _WRAPPED[cls]


__all__ = ["named_calls"]
