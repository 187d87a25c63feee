"""The optimizer both forms of `jamp.initialize` (linen and NNX) give back: `jamp.loss_scaled`
of the user's optax transformation, inside `jamp.master_weights` when the opt level keeps
float32 masters, with Apex's loss-scale settings and its once-only check."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jamp.frontend.masters import master_weights, to_float32
from jamp.policy import Properties
from jamp.policy.dtypes import FLOAT32, is_inexact_array
from jamp.scaler import (
    CountingStaticLossScale,
    DynamicLossScale,
    LossScaledTransformation,
    loss_scaled,
)

# Apex's dynamic loss scaler: 2**16 to start, doubled after 2000 clean steps, halved on overflow.
_APEX_INIT_SCALE = 2.0**16
_APEX_SCALE_WINDOW = 2000


def as_transformation(tx: Any, where: str) -> optax.GradientTransformation:
    """An optimizer given to `initialize`, as the optax transformation to set up: itself, or
    the transformation of an `optax.MultiSteps` (which optax and Flax take for one).

    Raises:
      RuntimeError: `tx` scales losses already (set up by `initialize`, or made by
        `jamp.loss_scaled`): Apex's "should only be passed through amp.initialize once".
      TypeError: `tx` is not an optax transformation.
    """
    if isinstance(tx, AmpTransformation):
        raise RuntimeError(
            f"{where} was set up by jamp.initialize already: an optimizer is passed through "
            f"initialize once (Apex: \"A given optimizer should only be passed through "
            f"amp.initialize once.\"), and a second pass would wrap its loss scale in another "
            f"one and unscale every grad twice. Keep using it as initialize set it up, or, to "
            f"set the model up again (at another level), start from your own optax optimizer "
            f"(a new optax.adam(...), say) and the model's float32 parameters.")
    if isinstance(tx, LossScaledTransformation):
        raise RuntimeError(
            f"{where} is already loss-scaled (made by jamp.loss_scaled): initialize adds the "
            f"loss scale (and master weights) itself, and a second one would unscale every "
            f"grad twice. Give initialize the plain optax optimizer.")
    if isinstance(tx, optax.MultiSteps):
        return tx.gradient_transformation()
    if not isinstance(tx, optax.GradientTransformation):
        raise TypeError(f"{where} must be an optax GradientTransformation or optax.MultiSteps, "
                        f"got {tx!r}.")
    return tx


def param_dtypes(model_dtype: Any, keep_bn: bool) -> frozenset[np.dtype]:
    """The dtypes the params of a model set up at `model_dtype` may have: float32 alone when
    the model is not cast, also float32 where batch norms stay float32 (`keep_bn`)."""
    if model_dtype is None:
        return frozenset({FLOAT32})
    return frozenset({np.dtype(model_dtype), FLOAT32} if keep_bn else {np.dtype(model_dtype)})


def apex_loss_scale(setting: Any, min_loss_scale: float | None, max_loss_scale: float):
    """The loss scale Apex's `loss_scale` option asks for: dynamic (Apex's scaler: 2**16,
    window 2000, factor 2, with the floor and ceiling) or a static number (counting its
    unskipped steps, as Apex's static scaler does)."""
    if setting == "dynamic":
        floor = 0.0 if min_loss_scale is None else min_loss_scale
        return DynamicLossScale(jnp.float32(_APEX_INIT_SCALE), period=_APEX_SCALE_WINDOW,
                                factor=2, min_loss_scale=jnp.float32(floor),
                                max_loss_scale=max_loss_scale)
    return CountingStaticLossScale(jnp.float32(setting))


class AmpTransformation(LossScaledTransformation):
    """An optimizer `initialize` returns: `jamp.loss_scaled` of the user's (at O2 inside
    `jamp.master_weights`). Its type tells a second `initialize` that it is set up already."""

    __slots__ = ()


def amp_optimizer(tx: optax.GradientTransformation, props: Properties, num_losses: int,
                  min_loss_scale: float | None, max_loss_scale: float,
                  allowed: frozenset[np.dtype], returned_params: list) -> AmpTransformation:
    """`tx` set up at `props`' level: loss-scaled (one scale per loss), with float32 masters
    where the level keeps them, else with its state in float32. Its `init` refuses params
    other than those `initialize` returned (`returned_params`, else dtypes in `allowed`)."""
    scales = [apex_loss_scale(props.loss_scale, min_loss_scale, max_loss_scale)
              for _ in range(num_losses)]
    if not props.master_weights:
        tx = _state_in_float32(tx)
    amp_tx = loss_scaled(tx, scales[0] if num_losses == 1 else scales, num_losses=num_losses)
    if props.master_weights:
        amp_tx = master_weights(amp_tx, num_losses=num_losses)

    def init(params):
        _check_optimizer_params(params, props.opt_level, allowed, returned_params)
        return amp_tx.init(params)

    return AmpTransformation(init, amp_tx.update)


def _state_in_float32(tx: optax.GradientTransformation) -> optax.GradientTransformation:
    """`tx` run on float32 copies of the params, so its state is float32 from `init` on.

    Without master weights the grads reach the optimizer unscaled in float32 (the scale is
    float32), and an optimizer initialized from half params would turn its half moments into
    float32 ones at the first update: a state whose types change (a jitted step compiles
    twice, `lax.scan` over steps fails). Apex's half optimizer state would instead keep Adam's
    second moment in float16, where it underflows. The updates are cast to the params' dtypes
    by `optax.apply_updates` as usual. For float32 params this changes nothing.
    """
    tx = optax.with_extra_args_support(tx)

    def init(params):
        return tx.init(to_float32(params))

    def update(updates, state, params=None, **extra_args):
        return tx.update(updates, state, None if params is None else to_float32(params),
                         **extra_args)

    return optax.GradientTransformationExtraArgs(init, update)


def _check_optimizer_params(params, opt_level, allowed, returned_params) -> None:
    """Refuses params that are not those `initialize` returned (the float32 originals given
    to an O2 optimizer, say): leaf by leaf against a returned model of the same structure,
    else against the dtypes the level allows."""
    structure: Any = jax.tree_util.tree_structure(params)  # a PyTreeDef: jaxlib has no stubs
    like = [r for r in returned_params if jax.tree_util.tree_structure(r) == structure]
    expected = (jax.tree_util.tree_leaves(like[0]) if like
                else [None] * structure.num_leaves)
    for (path, leaf), ref in zip(jax.tree_util.tree_leaves_with_path(params), expected,
                                 strict=True):
        if not is_inexact_array(leaf):
            continue
        dtype = np.dtype(leaf.dtype)
        wanted = {np.dtype(ref.dtype)} if ref is not None else allowed
        if dtype not in wanted:
            raise ValueError(
                f"this optimizer was set up for the {opt_level} params jamp.initialize "
                f"returned, but params{jax.tree_util.keystr(path)} is {dtype} (expected "
                f"{' or '.join(sorted(d.name for d in wanted))}): initialize it with the params "
                f"jamp.initialize returned.")


__all__ = ["AmpTransformation", "amp_optimizer", "apex_loss_scale", "as_transformation",
           "param_dtypes"]
