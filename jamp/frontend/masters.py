"""Apex's float32 master weights (opt level O2), as an optax wrapper.

The model holds half-precision params; the optimizer state holds a float32 copy of each (the
"masters"). One `update`:

1. copies the incoming half grads to float32 (the grads of the scaled loss: a wrapped
   `loss_scaled` then unscales them in float32, so small grads do not flush to zero),
2. runs the inner transformation on the float32 grads with the masters as its params,
3. applies its updates to the masters, and
4. returns the updates that take each half param to its new master cast to half.

Step 4's updates are float32 (`new_master_in_half - param`, both half values), so
`optax.apply_updates(params, updates)` lands on the master cast to half: exactly, unless a
parameter moves in one step by more than 2**24 times its new magnitude. A float32 param (a
batch norm's) is its own master: its master is kept equal to the updated param, bit for bit.
"""

from __future__ import annotations

import sys
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import optax

from jamp.policy.dtypes import is_inexact_array


class MasterWeightsState(NamedTuple):
    """State of `master_weights`.

    Attributes:
      masters: float32 copies of the floating params (other leaves as they are).
      inner_state: the wrapped transformation's state (its params are the masters).
    """

    masters: Any
    inner_state: optax.OptState

    # The wrapped `loss_scaled` state's fields, so that an O2 state reads like the others.
    @property
    def loss_scale(self):
        return self._loss_scaled().loss_scale

    @property
    def total_steps(self):
        return self._loss_scaled().total_steps

    @property
    def skipped_steps(self):
        return self._loss_scaled().skipped_steps

    @property
    def last_finite(self):
        return self._loss_scaled().last_finite

    def _loss_scaled(self):
        from jamp.scaler import find_loss_scaled_states
        found = find_loss_scaled_states(self.inner_state)
        if len(found) != 1:
            raise AttributeError("these master weights wrap no single loss_scaled state")
        return found[0]


def to_float32(tree: Any) -> Any:
    """`tree` with its floating and complex leaves as float32 arrays; other leaves as they are."""
    return jax.tree_util.tree_map(
        lambda x: jnp.asarray(x, jnp.float32) if is_inexact_array(x, python_scalars=True)
        else x, tree)


def master_weights(inner: optax.GradientTransformation,
                   num_losses: int = 1) -> optax.GradientTransformationExtraArgs:
    """Keeps float32 master copies of the params and runs `inner` on them.

    Args:
      inner: the optimizer (usually `jamp.loss_scaled(...)` of the user's).
      num_losses: with more than one, `update` takes a sequence of grad trees (one per loss,
        as `loss_scaled(num_losses=K)` does); each is copied to float32.

    Returns:
      An `optax.GradientTransformationExtraArgs` whose `update` needs `params` (the half
      model params) and whose state is a `MasterWeightsState`.

    Example:
      >>> import jax.numpy as jnp, optax, jamp
      >>> params = {"w": jnp.array([1.0, 2.0], jnp.float16)}
      >>> tx = jamp.master_weights(optax.sgd(1e-4))
      >>> opt_state = tx.init(params)
      >>> grads = {"w": jnp.array([1.0, 1.0], jnp.float16)}
      >>> for _ in range(2):  # each step is below float16's resolution at 1.0 and 2.0
      ...     updates, opt_state = tx.update(grads, opt_state, params)
      ...     params = optax.apply_updates(params, updates)
      >>> params["w"], jamp.master_params(opt_state)["w"]
      (Array([1., 2.], dtype=float16), Array([0.99979997, 1.9998    ], dtype=float32))
    """
    inner = optax.with_extra_args_support(inner)

    def init(params):
        masters = to_float32(params)
        return MasterWeightsState(masters=masters, inner_state=inner.init(masters))

    def update(updates, state, params=None, **extra_args):
        if params is None:
            raise ValueError("master_weights needs the model params in update(grads, state, "
                             "params): the updates take each param to its new master.")
        if num_losses == 1:
            grads = to_float32(updates)
        else:
            grads = [None if g is None else to_float32(g) for g in updates]
        master_updates, inner_state = inner.update(grads, state.inner_state, state.masters,
                                                   **extra_args)
        masters = optax.apply_updates(state.masters, master_updates)

        def to_new_master(param, master):
            if not is_inexact_array(param, python_scalars=True):
                return jnp.zeros_like(param)
            landing = jnp.asarray(master).astype(jnp.asarray(param).dtype)
            return landing.astype(jnp.float32) - jnp.asarray(param, jnp.float32)

        def kept_in_step(param, master, update):
            # A float32 param (a batch norm's, at O2) is its own master: keep the master equal
            # to what `optax.apply_updates` will make of the param, bit for bit.
            if (is_inexact_array(param, python_scalars=True)
                    and jnp.asarray(param).dtype == jnp.asarray(master).dtype):
                return optax.apply_updates(param, update)
            return master

        param_updates = jax.tree_util.tree_map(to_new_master, params, masters)
        masters = jax.tree_util.tree_map(kept_in_step, params, masters, param_updates)
        return param_updates, MasterWeightsState(masters=masters, inner_state=inner_state)

    return optax.GradientTransformationExtraArgs(init, update)


def plain_state(opt_state: Any) -> Any:
    """`opt_state` with Flax NNX Variables replaced by their values: `nnx.Optimizer` wraps
    each leaf of its `opt_state` in an `nnx.OptState` Variable. Returns `opt_state` itself
    when it holds none (without importing flax.nnx, which no Variable exists without)."""
    nnx = sys.modules.get("flax.nnx")
    if nnx is None:
        return opt_state
    is_var = lambda x: isinstance(x, nnx.Variable)
    if not any(is_var(x) for x in jax.tree_util.tree_leaves(opt_state, is_leaf=is_var)):
        return opt_state
    return nnx.as_pure(opt_state)


def find_master_states(opt_state: Any) -> list[MasterWeightsState]:
    """Every `MasterWeightsState` inside `opt_state` (NNX Variables seen through)."""
    is_ours = lambda x: isinstance(x, MasterWeightsState)
    return [x for x in jax.tree_util.tree_leaves(plain_state(opt_state), is_leaf=is_ours)
            if is_ours(x)]


def master_params(opt_state: Any, params: Any = None) -> Any:
    """The params the optimizer owns (Apex's `amp.master_params`): the float32 masters where
    the optimizer keeps them (O2), else `params` themselves (O0, O1, O3).

    Clip or inspect these, not the half model params: with masters, the optimizer steps them.

    Raises:
      ValueError: `opt_state` holds no masters and no `params` were given, or more than one
        set of masters.
    """
    found = find_master_states(opt_state)
    if len(found) > 1:
        raise ValueError(f"opt_state holds {len(found)} sets of master weights; pass the state "
                         f"of one optimizer.")
    if found:
        return found[0].masters
    if params is None:
        raise ValueError("this optimizer keeps no master weights (opt levels O0, O1, O3): its "
                         "master params are the model params; pass them as "
                         "master_params(opt_state, params).")
    return params


__all__: Sequence[str] = ("MasterWeightsState", "find_master_states", "master_params",
                          "master_weights", "plain_state", "to_float32")
