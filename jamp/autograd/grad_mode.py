"""torch's grad-mode names for JAX: `register_hook`, `no_grad`, `enable_grad`,
`set_grad_enabled`, `inference_mode`.

torch records a graph while grad mode is on and differentiates it later; JAX differentiates a
function when a transform (`jax.grad`, `jax.vjp`) traces it. So grad mode here is a property of
a function, not of a time: `no_grad()(fn)` is `fn` whose outputs carry no gradient, made with
`lax.stop_gradient`. The `with` forms are honest only where nothing is being traced (eagerly,
at the top level of a program): there no JAX value records anything, so "no gradient" holds
already and the block runs as it is. Inside a traced function a `with` block cannot reach the
values computed in it, so `with no_grad():` there raises and says to decorate a function
instead. `enable_grad` never has anything to undo: a `jax.grad` inside a `no_grad` function
differentiates as usual.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jamp._checks import check_bool
from jamp import _jax_internals as jx
from jamp.policy.dtypes import is_inexact

__all__ = ["enable_grad", "inference_mode", "no_grad", "register_hook", "set_grad_enabled"]


# -- register_hook ----------------------------------------------------------------------------

def register_hook(x: Any, hook: Callable[[Any], Any]) -> Any:
    """`x`, unchanged, with `hook` applied to its gradient: torch's `Tensor.register_hook`.

    Returns a value equal to `x` (an array or a pytree of floating arrays); when a reverse-mode
    transform (`jax.grad`, `jax.vjp`) differentiates through it, `hook` receives the gradient
    with respect to it and returns a replacement of the same structure, shapes and dtypes, or
    None to leave it unchanged. Use it to clip, scale, log or replace a gradient. Built on
    `jax.custom_vjp`, so it works under `jax.jit` and `jax.vmap`.

    `hook` runs when JAX traces the backward pass: under `jax.jit` that is once per
    compilation, so a hook that logs values uses `jax.debug.print` or `jax.debug.callback`.
    It is not called when no gradient reaches `x` (as in torch). Forward mode (`jax.jvp`) has
    no gradients: there `x` is returned as it is.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jamp.autograd.grad_mode import register_hook
      >>> def loss(x):
      ...     x = register_hook(x, lambda g: jnp.clip(g, -1.0, 1.0))
      ...     return (3.0 * x).sum()
      >>> jax.grad(loss)(jnp.ones(2))
      Array([1., 1.], dtype=float32)
    """
    if not callable(hook):
        raise TypeError(f"register_hook: hook must be callable, got {hook!r}")
    leaves, tree = jax.tree_util.tree_flatten(x)
    for path, leaf in jax.tree_util.tree_flatten_with_path(x)[0]:
        if not is_inexact(leaf):
            where = f" at {jax.tree_util.keystr(path)}" if path else ""
            raise TypeError(
                f"register_hook: cannot register a hook on a value that has no gradient: "
                f"{leaf!r}{where} is not a floating or complex array.")
    if not leaves or {"forward"} == frozenset().union(*map(jx.autodiff_kinds, leaves)):
        return x  # only forward mode acts: no gradient will reach the hook

    @jax.custom_vjp
    def identity(*xs):
        return xs

    def fwd(*xs):
        return tuple(p.value for p in xs), None

    def bwd(_, cts):
        if all(jx.is_symbolic_zero(c) for c in cts):
            return (None,) * len(cts)  # no gradient reaches x: torch does not call the hook
        cts = [jnp.zeros(c.aval.shape, c.aval.dtype) if jx.is_symbolic_zero(c) else c
               for c in cts]
        given = jax.tree_util.tree_unflatten(tree, cts)
        new = hook(given)
        if new is None:
            return tuple(cts)
        return tuple(_checked_gradient(new, given, hook))

    identity.defvjp(fwd, bwd, symbolic_zeros=True)
    return jax.tree_util.tree_unflatten(tree, list(identity(*leaves)))


def _checked_gradient(new, given, hook) -> list:
    name = getattr(hook, "__name__", repr(hook))
    new_leaves, new_tree = jax.tree_util.tree_flatten(new)
    old_leaves, old_tree = jax.tree_util.tree_flatten(given)
    if new_tree != old_tree:  # type: ignore[operator]  # jaxlib ships no stub for PyTreeDef
        raise TypeError(f"register_hook: hook {name} returned a value of structure {new_tree}; "
                        f"the gradient it was given has structure {old_tree}.")
    for new_leaf, old in zip(new_leaves, old_leaves, strict=True):
        shape, dtype = np.shape(new_leaf), getattr(new_leaf, "dtype", None)
        if shape != old.shape:
            raise ValueError(f"register_hook: hook {name} returned a gradient of shape "
                             f"{shape}; the gradient it was given has shape {old.shape}.")
        if dtype != old.dtype:
            raise TypeError(f"register_hook: hook {name} changed the gradient's dtype from "
                            f"{old.dtype} to {dtype}; return it in {old.dtype}.")
    return new_leaves


# -- grad mode --------------------------------------------------------------------------------

def _stop(tree):
    """`tree` with every floating or complex array leaf behind `lax.stop_gradient`; other
    leaves (integers, Python values) are returned as they are."""
    def stop(x):
        if isinstance(x, jax.Array) and is_inexact(x):
            return lax.stop_gradient(x)
        return x

    return jax.tree_util.tree_map(stop, tree)


class _GradMode:
    """A grad-mode setting usable as a function decorator and, where that is honest, as a
    context manager. `enabled=False` stops gradients; `enabled=True` leaves functions as they
    are (JAX differentiates whatever a transform asks for)."""

    _name = "grad mode"
    _bare = True  # usable as `@name` without parentheses, as torch allows

    def __new__(cls, *args, **kwargs):
        if cls._bare and len(args) == 1 and not kwargs and callable(args[0]):
            return cls()(args[0])
        return super().__new__(cls)

    def __init__(self, enabled: bool):
        self._enabled = enabled

    def __call__(self, fn: Callable) -> Callable:
        if not callable(fn):
            raise TypeError(f"{self._name}: expected a function to decorate, got {fn!r}")
        if self._enabled:
            return fn

        @functools.wraps(fn)
        def without_grad(*args, **kwargs):
            args, kwargs = _stop((args, kwargs))
            return _stop(fn(*args, **kwargs))

        return without_grad

    def __enter__(self) -> None:
        if not self._enabled and jx.tracing():
            raise RuntimeError(
                f"`with {self._name}:` inside a function that JAX is tracing cannot stop the "
                f"gradients of the values computed in the block: JAX differentiates the traced "
                f"function as a whole. Decorate a function instead ({self._name}(fn) or "
                f"@{self._name}), or apply jax.lax.stop_gradient to the values.")

    def __exit__(self, *exc) -> None:
        pass


class no_grad(_GradMode):
    """Functions whose outputs carry no gradient: torch's `torch.no_grad`.

    `no_grad()(fn)` (or `@no_grad`, `@no_grad()`) returns `fn` with `lax.stop_gradient` on its
    floating array arguments and results: differentiating through it gives zeros, and JAX keeps
    no residuals for the backward of what runs inside. `with no_grad():` runs its block as it is
    where nothing is being traced (eager code has no gradient to stop) and raises inside a
    traced function, where it could not stop anything.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jamp.autograd.grad_mode import no_grad
      >>> @no_grad
      ... def target(x):
      ...     return 2.0 * x
      >>> jax.grad(lambda x: (x * target(x)).sum())(jnp.ones(2))
      Array([2., 2.], dtype=float32)
    """

    _name = "no_grad"

    def __init__(self):
        super().__init__(False)


class enable_grad(_GradMode):
    """torch's `torch.enable_grad`: in JAX gradients are always available, so `enable_grad()(fn)`
    is `fn` itself and `with enable_grad():` runs its block as it is. A `jax.grad` inside a
    `no_grad` function differentiates as usual; what a `no_grad` function returns stays
    without gradient."""

    _name = "enable_grad"

    def __init__(self):
        super().__init__(True)


class set_grad_enabled(_GradMode):
    """torch's `torch.set_grad_enabled(mode)`: `no_grad` when `mode` is False, `enable_grad`
    when True, as a decorator and a context manager. Called as a statement it changes nothing:
    JAX has no process-wide grad mode to set."""

    _name = "set_grad_enabled(False)"
    _bare = False

    def __init__(self, mode: bool):
        super().__init__(check_bool("mode", mode))


class inference_mode(_GradMode):
    """torch's `torch.inference_mode(mode=True)`: the same as `no_grad` when `mode` is True
    (outputs carry no gradient; JAX has no separate inference tensors or version counters to
    skip), nothing when False."""

    _name = "inference_mode"

    def __init__(self, mode: bool = True):
        super().__init__(not check_bool("mode", mode))
