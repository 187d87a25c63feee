"""The delayed recipe as a precision rule's setting: its state, one `DelayedState` per product
keyed by module path, threaded by `jamp.fp8.with_state` (its gradient is the next state),
equals `jamp.fp8.dot_general(..., state=...)` called by hand; stacked per layer under
`nn.scan`; through remat, vmap and checkpoints (docs/fp8.md, "Delayed scaling")."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jamp

DELAYED = jamp.fp8.recipe("delayed", amax_history_length=4)
DENSE = (((1,), (0,)), ((), ()))


def _x(step):
    # Magnitudes that change from step to step (the first beyond e4m3's range).
    return jax.random.normal(jax.random.key(step), (4, 16)) * (500.0 / (step + 1))


def _mean_square(out):
    return jnp.mean(out ** 2) * 1e-4


def _row(tree, i):
    return jax.tree.map(lambda a: a[i], tree)


def _assert_trees_equal(a, b):
    jax.tree.map(np.testing.assert_array_equal, a, b)


@functools.cache
def _step(loss):
    """The jitted SGD step of `loss(params, state, x) -> (value, out)`."""
    @jax.jit
    def step(params, state, x):
        (_, out), (grads, state) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(
            params, state, x)
        return jax.tree.map(lambda p, g: p - 1e-3 * g, params, grads), state, (out, grads)
    return step


def _train(loss, params, state, steps, start=0):
    """`steps` SGD steps of `loss` from step `start`: the params and state after them, and
    each step's (output, params' gradient) and new state."""
    step = _step(loss)
    history = []
    for i in range(start, start + steps):
        params, state, seen = step(params, state, _x(i))
        history.append((seen, state))
    return params, state, history


class Dense(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(16)(x)


@pytest.fixture(scope="module")
def dense():
    model = Dense()
    return model, model.init(jax.random.key(0), _x(0))["params"]


def _dense_loss(model):
    def loss(params, x):
        out = model.apply({"params": params}, x)
        return _mean_square(out), out
    return jamp.autocast(loss, dtype=jnp.float32, rules=[("Dense_0", DELAYED)])


def test_a_delayed_rule_equals_the_fp8_dot_general_by_hand_over_three_steps(dense):
    model, params = dense
    loss_amp = _dense_loss(model)
    state = jamp.fp8.init_autocast_state(loss_amp, params, _x(0))
    assert list(state) == ["Dense/Dense_0"]
    _assert_trees_equal(state["Dense/Dense_0"], jamp.fp8.init_delayed_state(DELAYED))
    _, _, ours = _train(lambda p, s, x: jamp.fp8.with_state(loss_amp)(s, p, x), params, state,
                        3)

    def by_hand(params, state, x):
        out = jamp.fp8.dot_general(x, params["Dense_0"]["kernel"], DENSE, DELAYED,
                                   state=state["Dense/Dense_0"]) + params["Dense_0"]["bias"]
        return _mean_square(out), out

    _, _, theirs = _train(by_hand, params,
                          {"Dense/Dense_0": jamp.fp8.init_delayed_state(DELAYED)}, 3)
    _assert_trees_equal(ours, theirs)
    # The histories filled: the comparison saw delayed scaling work.
    assert int(jnp.sum(ours[-1][1]["Dense/Dense_0"].output_grad_amax_history > 0)) == 3


class Layer(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        return jnp.tanh(nn.Dense(16)(x)), None


class Scanned(nn.Module):
    @nn.compact
    def __call__(self, x):
        layers = nn.scan(nn.remat(Layer), variable_axes={"params": 0},
                         split_rngs={"params": True}, length=2)
        return layers(name="layers")(x, None)[0]


class Unrolled(nn.Module):
    @nn.compact
    def __call__(self, x):
        for i in range(2):
            x = Layer(name=f"layers_{i}")(x, None)[0]
        return x


def _layers_loss(model):
    def loss(params, x):
        out = model.apply({"params": params}, x)
        return _mean_square(out), out
    loss_amp = jamp.autocast(loss, dtype=jnp.float32, rules=[("layers*", DELAYED)])
    return loss_amp, lambda p, s, x: jamp.fp8.with_state(loss_amp)(s, p, x)


def test_nn_scan_stacks_the_state_per_layer_as_an_unrolled_model_keeps_it():
    scanned, unrolled = Scanned(), Unrolled()
    params = scanned.init(jax.random.key(1), _x(0))["params"]
    unrolled_params = {f"layers_{i}": {"Dense_0": _row(params["layers"]["Dense_0"], i)}
                       for i in range(2)}
    (loss_amp, loss), (_, unrolled_loss) = _layers_loss(scanned), _layers_loss(unrolled)
    state = jamp.fp8.init_autocast_state(loss_amp, params, _x(0))
    assert list(state) == ["Scanned/layers/Dense_0"]
    assert state["Scanned/layers/Dense_0"].input_amax_history.shape == (2, 4)
    unrolled_state = {f"Unrolled/layers_{i}/Dense_0": jamp.fp8.init_delayed_state(DELAYED)
                      for i in range(2)}
    _, state, ours = _train(loss, params, state, 2)
    _, unrolled_state, theirs = _train(unrolled_loss, unrolled_params, unrolled_state, 2)
    for i in range(2):
        jax.tree.map(np.testing.assert_allclose, _row(state["Scanned/layers/Dense_0"], i),
                     unrolled_state[f"Unrolled/layers_{i}/Dense_0"])
    np.testing.assert_allclose(ours[-1][0][0], theirs[-1][0][0], rtol=1e-6)


def test_remat_vmap_and_sharding_thread_the_state(dense):
    model, params = dense
    loss_amp = _dense_loss(model)
    state = jamp.fp8.init_autocast_state(loss_amp, params, _x(0))
    grad = jax.jit(jax.grad(jamp.fp8.with_state(loss_amp), has_aux=True))
    plain = grad(state, params, _x(0))[0]
    rematted = jax.jit(jax.grad(jamp.fp8.with_state(jamp.autocast(
        jax.checkpoint(lambda p, x: (_mean_square(model.apply({"params": p}, x)), x)),
        dtype=jnp.float32, rules=[("Dense_0", DELAYED)])), has_aux=True))(state, params, _x(0))
    _assert_trees_equal(rematted[0], plain)
    # vmap: each example its own state (mapped with the operands), as if called one by one.
    xs = jnp.stack([_x(0), _x(1)])
    states = jax.tree.map(lambda *leaves: jnp.stack(leaves), state, plain)
    mapped = jax.jit(jax.vmap(grad, in_axes=(0, None, 0)))(states, params, xs)[0]
    second = grad(plain, params, xs[1])[0]
    for i, alone in enumerate([plain, second]):
        jax.tree.map(np.testing.assert_allclose, _row(mapped, i), alone)
    # Sharded params and inputs (the features over 8 devices): the same new state.
    mesh = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
    spread = lambda a: jax.device_put(  # noqa: E731
        a, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(
            *[None] * (a.ndim - 1), "d")))
    sharded = grad(state, jax.tree.map(spread, params), spread(_x(0)))[0]
    jax.tree.map(np.testing.assert_allclose, sharded, plain)


def test_a_restored_checkpoint_steps_as_the_uninterrupted_run(dense, tmp_path):
    ocp = pytest.importorskip("orbax.checkpoint")
    model, params = dense
    loss_amp = jamp.fp8.with_state(_dense_loss(model))
    state = jamp.fp8.init_autocast_state(_dense_loss(model), params, _x(0))
    loss = lambda p, s, x: loss_amp(s, p, x)  # noqa: E731
    _, _, uninterrupted = _train(loss, params, state, 3)
    params2, state2, _ = _train(loss, params, state, 2)
    saved = {"params": params2, "fp8": state2}
    target = {"params": params, "fp8": state}
    from_bytes = jamp.checkpoint_from_bytes(target, jamp.checkpoint_to_bytes(saved))
    manager = ocp.CheckpointManager(tmp_path)
    jamp.save_checkpoint(manager, 2, saved)
    manager.wait_until_finished()
    from_orbax = jamp.restore_checkpoint(manager, target)
    for restored in (from_bytes, from_orbax):
        _, _, resumed = _train(loss, restored["params"], restored["fp8"], 1, start=2)
        _assert_trees_equal(resumed[0], uninterrupted[2])


class Shared(nn.Module):
    @nn.compact
    def __call__(self, x):
        w = self.param("w", nn.initializers.lecun_normal(), (16, 16))
        return nn.Einsum((16, 16), "bi,io->bo")((x @ w) @ w)


def test_keys_index_a_module_s_products_and_stack_a_lax_scan():
    x = _x(0)
    model = Shared()
    params = jax.tree.map(lambda s: jnp.ones(s.shape, s.dtype),
                          jax.eval_shape(model.init, jax.random.key(0), x))["params"]
    shared = jamp.autocast(lambda p, x: model.apply({"params": p}, x), dtype=DELAYED)
    # Two products of one module (in program order), and one inside jnp.einsum's jit.
    assert sorted(jamp.fp8.init_autocast_state(shared, params, x)) == [
        "Shared/Einsum_0", "Shared:0", "Shared:1"]

    def layers(w0, ws, x):
        return jax.lax.scan(lambda h, w: (h @ w, None), x @ w0, ws)[0]

    ws = jnp.ones((3, 16, 16))
    state = jamp.fp8.init_autocast_state(jamp.autocast(layers, dtype=DELAYED), ws[0], ws, x)
    assert {k: v.kernel_amax_history.shape for k, v in state.items()} == {
        "(top level):0": (4,), "(top level):1": (3, 4)}


def test_a_state_that_does_not_fit_and_a_missing_state_are_errors(dense):
    model, params = dense
    loss_amp = _dense_loss(model)
    other = {"Other/Dense_0": jamp.fp8.init_delayed_state(DELAYED)}
    with pytest.raises(ValueError, match=r"lacks 'Dense/Dense_0'.*has 'Other/Dense_0'"):
        jamp.fp8.with_state(loss_amp)(other, params, _x(0))
    longer = {"Dense/Dense_0": jamp.fp8.init_delayed_state(jamp.fp8.recipe("delayed"))}
    with pytest.raises(ValueError, match=r"'Dense/Dense_0' does not fit .*\(1024,\)"):
        jamp.fp8.with_state(loss_amp)(longer, params, _x(0))
    with pytest.raises(TypeError, match=r"jamp\.fp8\.with_state\(fn\)"):
        loss_amp(params, _x(0))
    with pytest.raises(TypeError, match="takes a function jamp.autocast returned"):
        jamp.fp8.with_state(model.apply)

    def looped(params, x):
        return jax.lax.fori_loop(0, jnp.int32(2), lambda i, h: model.apply(
            {"params": params}, h), x)

    with pytest.raises(ValueError, match="'Dense/Dense_0'.*while_loop"):
        jamp.fp8.init_autocast_state(jamp.autocast(looped, dtype=DELAYED), params, _x(0))
