"""The delayed recipe's state for a function `jamp.autocast` transformed with it as a rule's
setting (or its dtype): found by `init_autocast_state`, threaded by `with_state`.

The state is a dict from each delayed product's site to its `DelayedState`: the module path
of the product ("Net/Block_0/Dense_0"), with ":k" after it where one module runs several
(k in program order), and "(top level)" for a product outside every module. A product in the
body of a scan (`nn.scan` over layers, `lax.scan`) has its state stacked with a leading axis
per scan around it, as Flax stacks a scanned module's variables. As with
`jamp.fp8.dot_general(..., state=...)`, **the next state is the gradient with respect to the
state**: differentiate the step with respect to `(params, state)`.

`jamp.transforms` implements the two calls: a transformed function carries them in its
`STATE_CALLS` attribute (this package sits below `jamp.transforms` and does not import it).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

from jamp.fp8.delayed_scaling import DelayedState

# The attribute of an autocast-transformed function that holds its `StateCalls`.
STATE_CALLS = "__jamp_fp8_state__"


class StateCalls(NamedTuple):
    """What an autocast-transformed function does with delayed state.

    Attributes:
      init: `(args, kwargs) -> state`: fresh state for each delayed site of the function
        called on these arguments.
      call: `(state, args, kwargs) -> outputs`: the function called with that state.
    """

    init: Callable[[tuple, dict], dict[str, DelayedState]]
    call: Callable[[Any, tuple, dict], Any]


def init_autocast_state(fn: Callable, *args: Any, **kwargs: Any) -> dict[str, DelayedState]:
    """Fresh delayed-scaling state (scales 1, empty histories) for every product of `fn` a
    delayed recipe selects, as `fn` called on `args` runs them.

    `fn` is traced once for its program (no step runs); the sites are read from it.

    Args:
      fn: a function `jamp.autocast` returned, with `jamp.fp8.recipe("delayed", ...)` as a
        rule's setting or its dtype.
      *args, **kwargs: arguments of the step's shapes and dtypes (the first batch, say).

    Returns:
      A dict from each site (see the module docstring) to its `DelayedState`.

    Raises:
      TypeError: `fn` is not a function `jamp.autocast` returned.
      ValueError: a delayed product sits where its state cannot be threaded (a `while_loop`
        or `cond` body, a custom derivative rule's function, a `shard_map`).
    """
    return _calls(fn, "init_autocast_state").init(args, kwargs)


def with_state(fn: Callable) -> Callable:
    """`fn` taking the delayed state first: `with_state(fn)(state, *args, **kwargs)`.

    Differentiate the result with respect to the state (with `jax.grad(..., argnums=...)` or
    `has_aux`): its gradient is the next state. Called without differentiation (an
    evaluation step) it reads the state and updates nothing.

    Raises:
      TypeError: `fn` is not a function `jamp.autocast` returned.
      ValueError (when called): the state's sites are not `fn`'s (another model's state),
        naming the missing and the extra ones, or a site's arrays have other shapes (another
        recipe or number of layers).

    Example:
      >>> import jax, jax.numpy as jnp, jamp
      >>> def loss(w, x):
      ...     return jnp.mean((x @ w) ** 2)
      >>> loss_amp = jamp.autocast(loss, dtype=jamp.fp8.recipe("delayed", amax_history_length=4))
      >>> w, x = jnp.ones((16, 16)), jnp.ones((4, 16))
      >>> state = jamp.fp8.init_autocast_state(loss_amp, w, x)
      >>> list(state)
      ['(top level)']
      >>> grads, state = jax.grad(jamp.fp8.with_state(loss_amp), argnums=(1, 0))(state, w, x)
      >>> state["(top level)"].input_amax_history
      Array([1., 0., 0., 0.], dtype=float32)
    """
    calls = _calls(fn, "with_state")

    @functools.wraps(fn)
    def stateful(state: Any, *args: Any, **kwargs: Any) -> Any:
        return calls.call(state, args, kwargs)

    return stateful


def _calls(fn: Callable, name: str) -> StateCalls:
    calls = getattr(fn, STATE_CALLS, None)
    if not isinstance(calls, StateCalls):
        raise TypeError(f"jamp.fp8.{name} takes a function jamp.autocast returned (with "
                        f"jamp.fp8.recipe(\"delayed\") in its rules or as its dtype); got "
                        f"{fn!r}.")
    return calls


__all__ = ["init_autocast_state", "STATE_CALLS", "StateCalls", "with_state"]
