"""`loss_scaled`: an optax wrapper that unscales, checks, skips bad steps and adjusts the scale.

The wrapper's state holds the loss scale (any `LossScale`: jmp's, a `GradScalerState`, one of
yours) beside the inner optimizer's state. One `update`:

1. unscales the incoming grads (which the caller computed from `loss_scale.scale(loss)`),
2. folds the finiteness of every floating leaf into one scalar bool,
3. runs the inner update on the unscaled grads, and keeps its result only when finite:
   otherwise the updates are zeros and the inner state is the one from before, bit for bit,
4. adjusts the scale (grow after a run of finite steps, back off after a bad one).

Step 3 is, by default, a pair of `jnp.where`/`lax.select` selects, not a branch: XLA fuses them
into the inner update, which is where the speed comes from. With `skip="cond"` it is a
`lax.cond` around the inner update instead, which lets XLA update donated buffers in place (see
`loss_scaled`).
"""

from __future__ import annotations

import numbers
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from jamp._checks import check_bool, check_count, parse_loss_scale
from jamp.scaler.grad_scaler import GradScaler
from jamp.scaler.loss_scale import CountingStaticLossScale, all_finite, select_tree
from jamp.scaler.protocol import LossScale

_SKIP_MODES = ("select", "cond")


class LossScaledState(NamedTuple):
    """State of `loss_scaled`.

    Attributes:
      loss_scale: the current loss scale (a `LossScale`: `DynamicLossScale`,
        `GradScalerState`, ...); with `num_losses=K > 1`, a tuple of K of them.
      inner_state: the wrapped transformation's state, untouched by skipped steps.
      total_steps: int32, every `update` call.
      skipped_steps: int32, the calls whose grads held inf or nan (no update applied).
      last_finite: bool, whether the latest call's grads were finite (applied).
    """

    loss_scale: Any
    inner_state: optax.OptState
    total_steps: jax.Array
    skipped_steps: jax.Array
    last_finite: jax.Array


class LossScaledTransformation(optax.GradientTransformationExtraArgs):
    """What `loss_scaled` returns: an optax `GradientTransformationExtraArgs` (it chains,
    and Flax and NNX take it, as any other) whose type says that it scales losses, so that a
    second loss scale around it is refused where it is made."""

    __slots__ = ()


def _refuse_scaled_inner(inner_state: Any) -> None:
    """A loss scale inside the wrapped optimizer (a `loss_scaled` in a chain or another
    wrapper) would unscale every grad twice: refused when the state is made."""
    if find_loss_scaled_states(inner_state):
        raise ValueError(
            "loss_scaled got an optimizer that already scales losses: its state holds a loss "
            "scale already (a jamp.loss_scaled, or an optimizer jamp.initialize returned, "
            "inside a chain or another wrapper), so every grad would be unscaled twice. Wrap "
            "the plain optax optimizer once: jamp.loss_scaled(optax.chain(...)).")


def as_loss_scale(loss_scale: Any) -> Any:
    """Turns what `loss_scaled` accepts into a loss scale object.

    None or "dynamic" -> torch's defaults (`GradScaler().init()`); a `GradScaler` -> its
    `init()`; a number or numeric string -> a static scale that counts its finite steps
    (`CountingStaticLossScale`: Apex's `loss_scale=128.0`); a `LossScale` -> itself.
    """
    if loss_scale is None or (isinstance(loss_scale, str) and loss_scale == "dynamic"):
        return GradScaler().init()
    if isinstance(loss_scale, GradScaler):
        return loss_scale.init()
    if isinstance(loss_scale, LossScale):
        return loss_scale
    if isinstance(loss_scale, (bool, np.bool_)) or not isinstance(
            loss_scale, (str, numbers.Real, np.ndarray, jax.Array)):
        raise TypeError(
            f"loss_scale must be None, 'dynamic', a positive number, a GradScaler or a "
            f"jamp.scaler.LossScale (an object with loss_scale, scale, unscale and adjust), "
            f"got loss_scale={loss_scale!r}.")
    value = parse_loss_scale(loss_scale)
    if value == "dynamic":
        return GradScaler().init()
    return CountingStaticLossScale(jnp.float32(value))


def loss_scaled(
    inner: optax.GradientTransformation,
    loss_scale: Any = None,
    *,
    num_losses: int = 1,
    axis_name: Any = None,
    report: bool = False,
    skip: str = "select",
) -> optax.GradientTransformationExtraArgs:
    """Wraps `inner` so that it takes scaled grads and skips steps whose grads are not finite.

    Compute the grads of `get_loss_scale(opt_state).scale(loss)` and pass them to `update` as
    they are. Extra keyword arguments of `update` go to `inner`. Clipping inside `inner`
    (`optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))`) sees unscaled grads,
    Apex's rule.

    Args:
      inner: the optimizer to protect.
      loss_scale: the starting loss scale: None or "dynamic" (torch's defaults), a
        `GradScaler`, a `jamp.scaler.LossScale` (`DynamicLossScale`, `GradScalerState`, ...,
        or one of your own), or a number (a static scale). With `num_losses > 1`, one of
        these for all losses or a sequence of `num_losses`.
      num_losses: Apex's `num_losses`: K independent scales. `update` then takes a sequence
        of K grad trees, the k-th from `get_loss_scale(opt_state, loss_id=k).scale(loss_k)`
        (None for a loss that reaches none of these params: its scale is left unchanged);
        each is unscaled with its own scale, each scale adjusts to its own finiteness only,
        and the unscaled grads are summed for the inner update, which is skipped if any of
        them is not finite.
      axis_name: a shard_map/pmap axis: replicas agree, so one replica that saw inf makes all
        skip (the grads themselves are not averaged here). Not needed under `jax.jit` with
        sharded arrays, where the check is global already.
      report: print Apex's "Gradient overflow.  Skipping step, ..." line from the device
        (`jax.debug.print`) on each skipped step.
      skip: how a non-finite step is dropped; either way it leaves the inner state exactly as
        it was and returns zero updates. "select" (the default) runs the inner update on every
        step and keeps or drops its results with `jnp.where` selects, which XLA fuses into the
        update's own loops: no branch, the fastest when the optimizer state is not donated.
        When the state is donated to the jitted step (`donate_argnums`, as with a donated Flax
        `TrainState`), XLA then copies the old state every step, because the params update
        still reads it after the selects overwrite it in place. "cond" runs the inner update
        inside a `lax.cond` taken only on finite steps: no copies with donated buffers (the
        state is updated in place as without the wrapper), and a skipped step does no optimizer
        work. Under `jax.vmap` with a batched flag, JAX turns the cond back into selects.

    Returns:
      An `optax.GradientTransformationExtraArgs` (a `LossScaledTransformation`) whose state is
      a `LossScaledState`.

    Raises:
      TypeError: an argument of the wrong type (`loss_scale=True`, `report="yes"`).
      ValueError: a bad `loss_scale`, `num_losses` or `skip`; an `inner` that scales losses
        already (from `loss_scaled` or `jamp.initialize`; nested in a chain, at `init`).
    """
    if isinstance(inner, LossScaledTransformation):
        raise ValueError(
            "loss_scaled got an optimizer that already scales losses (made by "
            "jamp.loss_scaled, or returned by jamp.initialize): a second loss scale would "
            "unscale every grad twice. Wrap the plain optax optimizer once.")
    if skip not in _SKIP_MODES:
        raise ValueError(f"skip must be one of {list(_SKIP_MODES)}, got skip={skip!r}.")
    num_losses = check_count("num_losses", num_losses)
    report = check_bool("report", report)
    if num_losses == 1:
        initial = as_loss_scale(loss_scale)
    else:
        if isinstance(loss_scale, Sequence) and not isinstance(loss_scale, str):
            if len(loss_scale) != num_losses:
                raise ValueError(f"loss_scale has {len(loss_scale)} entries, but num_losses is "
                                 f"{num_losses}.")
            initial = tuple(as_loss_scale(ls) for ls in loss_scale)
        else:
            initial = (as_loss_scale(loss_scale),) * num_losses
    inner = optax.with_extra_args_support(inner)

    def init(params):
        inner_state = inner.init(params)
        _refuse_scaled_inner(inner_state)
        return LossScaledState(
            # Fresh buffers on every call: a state donated to a jitted step must not take the
            # arrays that the next `init` hands out with it.
            loss_scale=jax.tree_util.tree_map(jnp.array, initial),
            inner_state=inner_state,
            total_steps=jnp.zeros([], jnp.int32),
            skipped_steps=jnp.zeros([], jnp.int32),
            last_finite=jnp.array(True),
        )

    def update(updates, state, params=None, **extra_args):
        if num_losses == 1:
            scales, grad_trees = (state.loss_scale,), (updates,)
        else:
            scales, grad_trees = state.loss_scale, tuple(updates)
            if len(grad_trees) != num_losses:
                raise ValueError(f"update expects a sequence of {num_losses} grad trees (one "
                                 f"per loss), got {len(grad_trees)}.")
        # A None entry: that loss reaches none of these params (a GAN's generator loss, seen
        # by the discriminator's optimizer). Its scale is left as it is.
        present = [k for k, g in enumerate(grad_trees) if g is not None]
        if not present:
            raise ValueError("update got no grads: every entry of the sequence is None.")
        unscaled = {k: scales[k].unscale(grad_trees[k]) for k in present}
        finites = {k: all_finite(g, axis_name) for k, g in unscaled.items()}
        grads = unscaled[present[0]]
        for k in present[1:]:
            grads = jax.tree_util.tree_map(jnp.add, grads, unscaled[k])
        finite = finites[present[0]]
        for k in present[1:]:
            finite = finite & finites[k]

        def inner_update(grads, inner_state):
            return inner.update(grads, inner_state, params, **extra_args)

        if skip == "select":
            new_updates, new_inner = inner_update(grads, state.inner_state)
            new_updates = jax.tree_util.tree_map(
                lambda u: jnp.where(finite, u, jnp.zeros_like(u)), new_updates)
            # The old state in the new one's types: an inner update may change a leaf's dtype
            # (optax's moments of an int leaf become float), and a select needs one dtype.
            old_inner = jax.tree_util.tree_map(_as_type_of, state.inner_state, new_inner)
            new_inner = select_tree(finite, new_inner, old_inner)
        else:
            new_updates, new_inner = _update_if(finite, inner_update, grads, state.inner_state)
        new_scales = tuple(ls.adjust(finites[k]) if k in finites else ls
                           for k, ls in enumerate(scales))
        if report:
            for loss_id in present:
                _report_overflow(finites[loss_id], loss_id, new_scales[loss_id].loss_scale)
        return new_updates, LossScaledState(
            loss_scale=new_scales[0] if num_losses == 1 else new_scales,
            inner_state=new_inner,
            # Counters saturate at the int32 maximum rather than wrap negative.
            total_steps=optax.safe_increment(state.total_steps),
            skipped_steps=jnp.where(finite, state.skipped_steps,
                                    optax.safe_increment(state.skipped_steps)),
            last_finite=finite,
        )

    return LossScaledTransformation(init, update)


def _update_if(finite, inner_update, grads, inner_state):
    """`inner_update(grads, inner_state)` when `finite`, else zero updates and `inner_state`."""
    # The skipped branch must return the taken branch's types: the updates may differ from the
    # grads in dtype (an inner transformation that casts), and under shard_map the new state
    # may vary over more mesh axes than the old one. `zeros_like` of the traced types carries
    # both. (Reading them costs one more trace of the inner update, none at run time.)
    if not isinstance(finite, jax.core.Tracer):
        # Called eagerly, the flag is known: take the branch here. An eager lax.cond would
        # trace and compile both branches anew at every step.
        if bool(finite):
            return inner_update(grads, inner_state)
        update_types, _ = jax.eval_shape(inner_update, grads, inner_state)
        return jax.tree_util.tree_map(jnp.zeros_like, update_types), inner_state
    update_types, state_types = jax.eval_shape(inner_update, grads, inner_state)

    def skipped(grads, inner_state):
        zeros = jax.tree_util.tree_map(jnp.zeros_like, update_types)
        return zeros, jax.tree_util.tree_map(_as_type_of, inner_state, state_types)

    return lax.cond(finite, inner_update, skipped, grads, inner_state)


def _as_type_of(x, like):
    """`x` in the dtype of `like`, with the mesh axes it varies over widened to `like`'s.

    The value is kept: only an inner update that changes a leaf's dtype (an int leaf's moment
    turning float) changes it, by a cast that is exact for the counts such leaves hold.
    """
    x = jnp.asarray(x)
    if x.dtype != like.dtype:
        x = x.astype(like.dtype)
    zero = jnp.zeros_like(like)
    if jax.typeof(zero) == jax.typeof(x):
        return x
    # x - 0 keeps every value bit for bit (-0.0 included, which x + 0 would turn into +0.0).
    return x | zero if x.dtype == jnp.bool_ else x - zero


def _report_overflow(finite: jax.Array, loss_id: int, new_scale: Any) -> None:
    def say():
        jax.debug.print(
            "Gradient overflow.  Skipping step, loss scaler {loss_id} reducing loss scale to "
            "{scale}", loss_id=loss_id, scale=new_scale)

    # A cond only around the print: the numbers never depend on it.
    if isinstance(finite, jax.core.Tracer):
        lax.cond(finite, lambda: None, say)
    elif not bool(finite):
        say()


def find_loss_scaled_states(opt_state: Any) -> list[LossScaledState]:
    """Every `LossScaledState` inside `opt_state` (through chains and any other pytree)."""
    is_ours = lambda x: isinstance(x, LossScaledState)
    return [x for x in jax.tree_util.tree_leaves(opt_state, is_leaf=is_ours) if is_ours(x)]


def get_loss_scale(opt_state: Any, loss_id: int = 0) -> Any:
    """The current loss scale inside `opt_state`, wherever `loss_scaled` sits in it.

    Works through `optax.chain`, `optax.MultiSteps`, `optax.inject_hyperparams` and any other
    pytree of states. The result is a `LossScale` (`scale(tree)`, `unscale(tree)`,
    `loss_scale`, `adjust`).

    Args:
      opt_state: an optimizer state holding one `LossScaledState`.
      loss_id: which loss's scale, with `num_losses > 1` (Apex's `loss_id`).

    Raises:
      ValueError: no `loss_scaled` state in `opt_state`, more than one, or a bad `loss_id`.
    """
    found = find_loss_scaled_states(opt_state)
    if len(found) != 1:
        raise ValueError(
            f"get_loss_scale expects an optimizer state holding exactly one loss_scaled state, "
            f"found {len(found)}.")
    scales = found[0].loss_scale
    if isinstance(scales, tuple):
        if not (isinstance(loss_id, int) and 0 <= loss_id < len(scales)):
            raise ValueError(f"loss_id must be an integer in [0, {len(scales)}), got {loss_id!r}.")
        return scales[loss_id]
    if loss_id != 0:
        raise ValueError(f"loss_id must be 0 for a single loss scale, got {loss_id!r}.")
    return scales


__all__ = [
    "as_loss_scale", "find_loss_scaled_states", "get_loss_scale", "loss_scaled", "LossScaledState",
    "LossScaledTransformation"
]
