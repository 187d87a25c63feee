"""`jamp.scale_loss` and Apex's `unskipped` count where several losses share one loss scale:
jamp adjusts each scale once per `update`, Apex once per `scale_loss` (docs/apex.md,
"Differences from Apex")."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

import jamp

MODEL = nn.Dense(2)
X = jnp.ones((4, 3))


def _setup(unskipped):
    """A Dense under Apex's dynamic scaler (window 2000), `unskipped` clean steps in."""
    apply_fn, variables, tx = jamp.initialize(
        MODEL.apply, MODEL.init(jax.random.key(0), X), optax.sgd(0.1), opt_level="O0",
        loss_scale="dynamic", verbosity=0)
    params = variables["params"]
    state = jamp.load_state_dict(tx.init(params), {
        "loss_scaler0": {"loss_scale": 2.0**16, "unskipped": unskipped}})

    def two_losses(params, state, x):
        out = apply_fn({"params": params}, x)
        return (jamp.scale_loss(jnp.mean(out**2), state)
                + jamp.scale_loss(jnp.mean(out), state))

    @jax.jit
    def step(state, x):
        return tx.update(jax.grad(two_losses)(params, state, x), state, params)[1]

    return state, step


def test_two_losses_sharing_a_scale_count_once_per_update():
    # Apex counts each scale_loss: 1998 + 2 reaches its window, and its scale doubles at the
    # first step. jamp's scale_loss only reads the state; the update counts the step once.
    state, step = _setup(unskipped=1998)
    state = step(state, X)
    assert jamp.state_dict(state) == {"loss_scaler0": {"loss_scale": 2.0**16,
                                                       "unskipped": 1999}}
    state = step(state, X)
    assert jamp.state_dict(state) == {"loss_scaler0": {"loss_scale": 2.0**17,
                                                       "unskipped": 0}}


def test_two_overflowing_losses_halve_the_scale_once_per_update():
    # Apex halves once per overflowing backward pass, twice here.
    state, step = _setup(unskipped=5)
    state = step(state, X.at[0, 0].set(jnp.inf))
    assert jamp.state_dict(state) == {"loss_scaler0": {"loss_scale": 2.0**15,
                                                       "unskipped": 0}}
    assert int(state.skipped_steps) == 1
