"""torch's GradScaler, functional: parity with the real torch.amp.GradScaler (CPU build), its
settings, and its states: values of arrays and hashable settings."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jamp.scaler as js

# Settings to replay in torch and jamp: torch's defaults with a short interval so growth
# happens often, other float32-exact factors, and a scale so large that growth overflows
# float32 (torch then keeps the scale and resets the tracker).
SETTINGS = [
    dict(init_scale=65536.0, growth_factor=2.0, backoff_factor=0.5, growth_interval=3),
    dict(init_scale=3.0, growth_factor=3.0, backoff_factor=0.25, growth_interval=2),
    dict(init_scale=2.0**120, growth_factor=2.0**5, backoff_factor=0.75, growth_interval=1),
    dict(init_scale=1.0, growth_factor=1.5, backoff_factor=0.875, growth_interval=5),
]
IDS = ["defaults-interval3", "odd-factors", "growth-overflows", "slow-growth"]


def fault_sequence(n, seed):
    """Per step a multiplier for the loss: 1 (finite), inf or nan."""
    rng = np.random.default_rng(seed)
    return rng.choice(np.array([1.0, np.inf, np.nan], np.float32), size=n, p=[0.8, 0.12, 0.08])


def torch_trajectory(torch, settings, faults, x):
    """Scale, tracker and params after every step of torch's scaler + SGD."""
    scaler = torch.amp.GradScaler("cpu", **settings)
    p = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.SGD([p], lr=0.01)
    scales, trackers, params = [], [], []
    for f in faults:
        opt.zero_grad()
        loss = (p * torch.tensor(x) * float(f)).sum()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
        trackers.append(scaler.state_dict()["_growth_tracker"])
        params.append(p.detach().numpy().copy())
    return np.array(scales, np.float32), np.array(trackers), np.array(params)


def jamp_step(scaler, sgd):
    """One step written with the GradScaler API only (scale, unscale, update, select_tree)."""

    def step(carry, f):
        state, p, opt_state = carry
        x = jnp.asarray([0.5, -1.0, 2.0, 0.25], jnp.float32)
        grads = jax.grad(lambda p: scaler.scale(state, jnp.sum(p * x * f)))(p)
        grads, found_inf = scaler.unscale(state, grads)
        updates, new_opt = sgd.update(grads, opt_state, p)
        p = js.select_tree(found_inf, p, optax.apply_updates(p, updates))
        opt_state = js.select_tree(found_inf, opt_state, new_opt)
        state = scaler.update(state, found_inf)
        return (state, p, opt_state), (state.loss_scale, state.counter, p)

    return step


X = np.array([0.5, -1.0, 2.0, 0.25], np.float32)


@pytest.mark.parametrize("settings", SETTINGS, ids=IDS)
def test_trajectory_matches_torch_under_scan(torch, settings):
    faults = fault_sequence(1500, seed=len(IDS[SETTINGS.index(settings)]))
    want_scale, want_tracker, want_params = torch_trajectory(torch, settings, faults, X)
    scaler, sgd = js.GradScaler(**settings), optax.sgd(0.01)
    carry = (scaler.init(), jnp.ones(4), sgd.init(jnp.ones(4)))
    _, (scales, trackers, params) = jax.jit(
        lambda c, fs: jax.lax.scan(jamp_step(scaler, sgd), c, fs))(carry, jnp.asarray(faults))
    np.testing.assert_array_equal(np.asarray(scales), want_scale)
    np.testing.assert_array_equal(np.asarray(trackers), want_tracker)
    np.testing.assert_allclose(np.asarray(params), want_params, rtol=1e-6, atol=1e-6)
    # The sequence exercised every branch of the rule.
    assert (np.diff(want_scale) > 0).any() and (np.diff(want_scale) < 0).any()


def test_trajectory_matches_torch_eagerly(torch):
    settings = SETTINGS[0]
    faults = fault_sequence(60, seed=1)
    want_scale, want_tracker, want_params = torch_trajectory(torch, settings, faults, X)
    scaler, sgd = js.GradScaler(**settings), optax.sgd(0.01)
    carry = (scaler.init(), jnp.ones(4), sgd.init(jnp.ones(4)))
    step = jamp_step(scaler, sgd)
    for i, f in enumerate(faults):
        carry, (scale, tracker, p) = step(carry, jnp.float32(f))
        assert scaler.get_scale(carry[0]) == want_scale[i]
        assert int(tracker) == want_tracker[i]
        np.testing.assert_allclose(p, want_params[i], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("settings", SETTINGS[:2], ids=IDS[:2])
def test_loss_scaled_with_grad_scaler_matches_torch(torch, settings):
    faults = fault_sequence(400, seed=7)
    want_scale, want_tracker, want_params = torch_trajectory(torch, settings, faults, X)
    tx = js.loss_scaled(optax.sgd(0.01), js.GradScaler(**settings))

    def step(carry, f):
        p, opt_state = carry
        ls = js.get_loss_scale(opt_state)
        grads = jax.grad(lambda p: ls.scale(jnp.sum(p * jnp.asarray(X) * f)))(p)
        updates, opt_state = tx.update(grads, opt_state, p)
        p = optax.apply_updates(p, updates)
        ls = js.get_loss_scale(opt_state)
        return (p, opt_state), (ls.loss_scale, ls.counter, p)

    p = jnp.ones(4)
    (_, opt_state), (scales, trackers, params) = jax.jit(
        lambda c, fs: jax.lax.scan(step, c, fs))((p, tx.init(p)), jnp.asarray(faults))
    np.testing.assert_array_equal(np.asarray(scales), want_scale)
    np.testing.assert_array_equal(np.asarray(trackers), want_tracker)
    np.testing.assert_allclose(np.asarray(params), want_params, rtol=1e-6, atol=1e-6)
    assert int(opt_state.total_steps) == len(faults)
    assert int(opt_state.skipped_steps) == int((~np.isfinite(faults)).sum())


@pytest.mark.parametrize("scale", [65536.0, 3.0, 12345.678, 0.1, 2.0**-10, 7.0e30])
def test_unscale_is_torchs_float32_reciprocal(torch, scale, variant):
    rng = np.random.default_rng(3)
    g = (rng.standard_normal(257) * 1000).astype(np.float32)
    scaler = torch.amp.GradScaler("cpu", init_scale=scale)
    p = torch.nn.Parameter(torch.zeros(257))
    opt = torch.optim.SGD([p], lr=1.0)
    scaler.scale(torch.zeros(()))  # torch creates its scale tensor lazily
    p.grad = torch.tensor(g)
    scaler.unscale_(opt)
    ours = js.GradScaler(init_scale=scale)
    got, found_inf = variant(ours.unscale)(ours.init(), {"g": jnp.asarray(g)})
    np.testing.assert_array_equal(np.asarray(got["g"]), p.grad.numpy())
    assert not bool(found_inf)


def test_unscale_half_grads_like_torchs_kernel(torch):
    rng = np.random.default_rng(4)
    g16 = (rng.standard_normal(300) * 100).astype(np.float16)
    scale = 3.0
    t = torch.tensor(g16)
    found = torch.zeros(1)
    inv = torch.full((), scale, dtype=torch.float32).double().reciprocal().float()
    torch._amp_foreach_non_finite_check_and_unscale_([t], found, inv)
    ours = js.GradScaler(init_scale=scale)
    grads = {"h": jnp.asarray(g16), "f": jnp.ones(2, jnp.float32), "step": jnp.array(5)}
    got, found_inf = ours.unscale(ours.init(), grads)
    assert got["h"].dtype == jnp.float16 and got["f"].dtype == jnp.float32
    assert got["step"].dtype == jnp.int32 and int(got["step"]) == 5
    np.testing.assert_array_equal(np.asarray(got["h"]), t.numpy())
    assert not bool(found_inf)


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_unscale_finds_inf_in_any_leaf(bad, variant):
    scaler = js.GradScaler()
    grads = {"a": jnp.ones(3), "b": jnp.array([1.0, bad], jnp.float16), "n": None,
             "i": jnp.array([1, 2])}
    _, found_inf = variant(scaler.unscale)(scaler.init(), grads)
    assert found_inf.dtype == jnp.bool_ and bool(found_inf)


def test_scale_dtypes_follow_torch(torch):
    scaler = js.GradScaler(init_scale=1024.0)
    state = scaler.init()
    loss16 = jnp.float16(2.0)  # a 0-d loss promotes with the float32 scale (as in torch)
    assert scaler.scale(state, loss16).dtype == jnp.float32
    assert float(scaler.scale(state, loss16)) == 2048.0
    outs = [jnp.ones(3, jnp.float16), jnp.float32(1.5)]
    got = scaler.scale(state, outs)
    assert isinstance(got, list) and got[0].dtype == jnp.float16
    want = torch.amp.GradScaler("cpu", init_scale=1024.0).scale(
        [torch.ones(3, dtype=torch.float16), torch.tensor(1.5)])
    assert str(want[0].dtype) == "torch.float16"
    np.testing.assert_array_equal(np.asarray(got[0]), want[0].numpy())
    assert float(got[1]) == float(want[1])


def test_update_with_new_scale_keeps_tracker():
    scaler = js.GradScaler(growth_interval=10)
    state = scaler.update(scaler.init(), jnp.array(False))
    state = scaler.update(state, new_scale=8.0)
    assert scaler.get_scale(state) == 8.0 and int(state.counter) == 1
    assert state.loss_scale.dtype == jnp.float32
    state = scaler.update(state, new_scale=jnp.array([4.0]))
    assert scaler.get_scale(state) == 4.0
    with pytest.raises(ValueError, match="new_scale.*> 0.*-1"):
        scaler.update(state, new_scale=-1.0)
    with pytest.raises(ValueError, match="found_inf"):
        scaler.update(state)


def test_update_accepts_torch_style_float_found_inf():
    scaler = js.GradScaler()
    state = scaler.update(scaler.init(), jnp.float32(1.0))
    assert scaler.get_scale(state) == 32768.0
    state = scaler.update(state, jnp.float32(0.0))
    assert int(state.counter) == 1


def test_state_dict_has_torchs_five_keys_and_types(torch):
    ours = js.GradScaler(growth_interval=7)
    theirs = torch.amp.GradScaler("cpu", growth_interval=7)
    sd = ours.state_dict(ours.update(ours.init(), jnp.array(False)))
    assert list(sd) == list(theirs.state_dict())
    assert [type(v) for v in sd.values()] == [float, float, float, int, int]
    assert sd == {"scale": 65536.0, "growth_factor": 2.0, "backoff_factor": 0.5,
                  "growth_interval": 7, "_growth_tracker": 1}


def test_torch_state_dict_loads_and_trajectories_continue_together(torch):
    settings = SETTINGS[0]
    faults = fault_sequence(40, seed=11)
    theirs = torch.amp.GradScaler("cpu", **settings)
    p = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.SGD([p], lr=0.01)

    def torch_step(f):
        opt.zero_grad()
        theirs.scale((p * torch.tensor(X) * float(f)).sum()).backward()
        theirs.step(opt)
        theirs.update()

    for f in faults[:20]:
        torch_step(f)
    ours = js.GradScaler()  # default settings: load_state_dict brings torch's
    state = ours.load_state_dict(theirs.state_dict())
    assert ours.get_growth_interval() == settings["growth_interval"]
    update = jax.jit(lambda s, f: ours.update(s, ~js.all_finite(f)))
    for f in faults[20:]:
        torch_step(f)
        state = update(state, jnp.float32(f))
        assert ours.state_dict(state) == theirs.state_dict()


def test_jamp_state_dict_loads_into_torch(torch):
    ours = js.GradScaler(init_scale=1024.0, growth_factor=4.0, backoff_factor=0.25,
                         growth_interval=5)
    state = ours.init()
    for found in (False, False, True, False):
        state = ours.update(state, jnp.array(found))
    theirs = torch.amp.GradScaler("cpu")
    theirs.load_state_dict(ours.state_dict(state))
    assert theirs.state_dict() == ours.state_dict(state)
    assert theirs.get_scale() == 256.0 and theirs.get_growth_factor() == 4.0


def test_disabled_is_a_no_op_like_torch(torch, variant):
    ours = js.GradScaler(enabled=False)
    theirs = torch.amp.GradScaler("cpu", enabled=False)
    state = ours.init()
    assert not ours.is_enabled() and not theirs.is_enabled()
    assert ours.get_scale(state) == theirs.get_scale() == 1.0
    loss = jnp.float16(3.0)
    assert ours.scale(state, loss) is loss
    grads = {"g": jnp.array([1.0, np.inf])}
    got, found_inf = variant(ours.unscale)(state, grads)
    np.testing.assert_array_equal(got["g"], grads["g"])
    assert not bool(found_inf)
    assert ours.update(state, jnp.array(True)) is state
    assert ours.state_dict(state) == theirs.state_dict() == {}
    assert ours.get_scale(ours.load_state_dict({})) == 1.0  # no-op, as torch's


def test_load_empty_state_dict_raises_torchs_runtime_error(torch):
    theirs = torch.amp.GradScaler("cpu")
    with pytest.raises(RuntimeError) as torch_error:
        theirs.load_state_dict({})
    with pytest.raises(RuntimeError) as our_error:
        js.GradScaler().load_state_dict({})
    assert str(our_error.value) == str(torch_error.value)
    assert "disabled instance of GradScaler" in str(our_error.value)


def test_load_state_dict_missing_key():
    with pytest.raises(KeyError, match="_growth_tracker"):
        js.GradScaler().load_state_dict({"scale": 2.0, "growth_factor": 2.0,
                                         "backoff_factor": 0.5, "growth_interval": 3})


@pytest.mark.parametrize("key,value,message", [
    ("_growth_tracker", -1, r"_growth_tracker.*>= 0.*-1"),
    ("_growth_tracker", 1.5, r"_growth_tracker.*1.5"),
    ("scale", 0.0, r"scale.*> 0.*0.0"),
    ("backoff_factor", 2.0, r"backoff_factor.*\(0, 1\).*2.0"),
    ("growth_interval", 1.5, r"growth_interval.*integer.*1.5"),
])
def test_load_state_dict_rejects_bad_values(key, value, message):
    good = {"scale": 2.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 3,
            "_growth_tracker": 1}
    with pytest.raises(ValueError, match=message):
        js.GradScaler().load_state_dict({**good, key: value})


def test_accessors_and_setters():
    scaler = js.GradScaler(growth_factor=3.0, backoff_factor=0.25, growth_interval=4)
    assert (scaler.get_growth_factor(), scaler.get_backoff_factor(),
            scaler.get_growth_interval()) == (3.0, 0.25, 4)
    scaler.set_growth_factor(4.0)
    scaler.set_backoff_factor(0.5)
    scaler.set_growth_interval(1)
    state = scaler.update(scaler.init(), jnp.array(False))  # interval 1: grows at once
    assert scaler.get_scale(state) == 65536.0 * 4.0
    state = scaler.update(state, jnp.array(True))
    assert scaler.get_scale(state) == 65536.0 * 2.0
    with pytest.raises(ValueError, match="growth_factor.*> 1.*0.9"):
        scaler.set_growth_factor(0.9)
    with pytest.raises(ValueError, match=r"backoff_factor.*\(0, 1\).*1.5"):
        scaler.set_backoff_factor(1.5)
    with pytest.raises(ValueError, match="growth_interval.*integer.*2.5"):
        scaler.set_growth_interval(2.5)


def test_equal_settings_give_one_tree_structure_and_one_compile():
    first, second = js.GradScaler().init(), js.GradScaler().init()
    assert jax.tree.structure(first) == jax.tree.structure(second)
    total = jax.tree.map(jnp.add, first, second)
    assert float(total.loss_scale) == 2.0**17 and total.growth_interval == 2000
    traces = []

    @jax.jit
    def step(state):
        traces.append(state)  # runs once per trace
        return state.adjust(jnp.array(False))

    for state in (first, second, step(first)):
        step(state)
    assert len(traces) == 1
    # Other settings are another structure: the step traces again and runs them.
    other = js.GradScaler(backoff_factor=0.25).init()
    assert jax.tree.structure(other) != jax.tree.structure(first)
    assert float(step(other).loss_scale) == 2.0**14 and len(traces) == 2


def test_loss_scaled_states_of_equal_settings_share_a_compile():
    params, grads = {"w": jnp.ones(3)}, {"w": jnp.ones(3)}
    txs = [js.loss_scaled(optax.sgd(0.1), js.GradScaler()) for _ in range(2)]
    states = [tx.init(params) for tx in txs]
    assert jax.tree.structure(states[0]) == jax.tree.structure(states[1])
    traces = []

    @jax.jit
    def update(opt_state):
        traces.append(opt_state)
        return txs[0].update(grads, opt_state, params)

    for state in states:
        update(state)
    assert len(traces) == 1


def test_setters_take_effect_at_the_next_update_whose_state_carries_them(variant):
    scaler = js.GradScaler(init_scale=2.0**16, growth_interval=1)
    state = scaler.init()
    scaler.set_growth_factor(4.0)
    new = variant(scaler.update)(state, jnp.array(False))
    assert scaler.get_scale(new) == 2.0**18 and new.growth_factor == 4.0
    assert float(new.adjust(True).loss_scale) == 2.0**20
    assert scaler.state_dict(new)["growth_factor"] == 4.0
    # A state is a value: the one made before the change keeps its settings.
    assert state.growth_factor == 2.0 and float(state.adjust(True).loss_scale) == 2.0**17


def test_loss_scaled_runs_the_settings_its_state_carries():
    scaler = js.GradScaler(init_scale=2.0**16, growth_interval=1)
    tx = js.loss_scaled(optax.sgd(0.1), scaler)  # takes the scaler's settings, as optax
    scaler.set_growth_factor(8.0)                  # takes a learning rate
    params, grads = {"w": jnp.ones(3)}, {"w": jnp.ones(3)}
    update = jax.jit(tx.update)
    _, opt_state = update(grads, tx.init(params), params)
    assert float(js.get_loss_scale(opt_state).loss_scale) == 2.0**17
    changed = dataclasses.replace(js.get_loss_scale(opt_state), growth_factor=4.0)
    _, opt_state = update(grads, opt_state._replace(loss_scale=changed), params)
    assert float(js.get_loss_scale(opt_state).loss_scale) == 2.0**19


def test_load_state_dict_returns_a_state_of_the_loaded_settings():
    scaler = js.GradScaler(growth_interval=3)
    before = scaler.init()
    state = scaler.load_state_dict({"scale": 8.0, "growth_factor": 3.0, "backoff_factor": 0.5,
                                    "growth_interval": 1, "_growth_tracker": 0})
    assert (state.growth_factor, state.growth_interval) == (3.0, 1)
    assert float(state.adjust(True).loss_scale) == 8.0 * 3.0
    assert (before.growth_factor, before.growth_interval) == (2.0, 3)


def test_a_state_made_by_hand_checks_its_settings():
    with pytest.raises(ValueError, match="growth_factor.*> 1.*0.5"):
        js.GradScalerState(jnp.float32(1.0), jnp.int32(0), growth_factor=0.5)
    with pytest.raises(TypeError, match="enabled"):
        js.GradScalerState(jnp.float32(1.0), jnp.int32(0), enabled="yes")


BAD = [
    (dict(init_scale=0.0), r"init_scale.*> 0.*0.0"),
    (dict(init_scale=-4.0), r"init_scale.*> 0.*-4.0"),
    (dict(init_scale=float("nan")), r"init_scale.*finite.*nan"),
    (dict(growth_factor=1.0), r"growth_factor.*> 1.*1.0"),
    (dict(growth_factor=0.5), r"growth_factor.*> 1.*0.5"),
    (dict(backoff_factor=1.0), r"backoff_factor.*\(0, 1\).*1.0"),
    (dict(backoff_factor=0.0), r"backoff_factor.*\(0, 1\).*0.0"),
    (dict(backoff_factor=-0.5), r"backoff_factor.*\(0, 1\).*-0.5"),
    (dict(growth_interval=10.5), r"growth_interval.*integer.*10.5"),
    (dict(growth_interval=0), r"growth_interval.*>= 1.*0"),
]


@pytest.mark.parametrize("kwargs,message", BAD, ids=[m for _, m in BAD])
def test_bad_settings_raise_value_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        js.GradScaler(**kwargs)


def test_integral_float_interval_is_accepted_as_int():
    scaler = js.GradScaler(growth_interval=2000.0)
    assert scaler.get_growth_interval() == 2000
    assert isinstance(scaler.state_dict(scaler.init())["growth_interval"], int)


@pytest.mark.parametrize("scale", [2.0**126 * 1.5, 2.0**127 * 1.9])
def test_huge_scale_does_not_flush_grads_to_zero(scale, variant):
    # The float32 reciprocal of these scales is subnormal, which XLA on CPU flushes to zero.
    scaler = js.GradScaler(init_scale=scale)
    grads = {"g": jnp.asarray([0.5, -1.0], jnp.float32) * jnp.float32(scale)}
    got, found_inf = variant(scaler.unscale)(scaler.init(), grads)
    np.testing.assert_allclose(np.asarray(got["g"]), [0.5, -1.0], rtol=1e-6, atol=1e-6)
    assert not bool(found_inf)


def test_non_float32_factors_match_torch_with_x64(torch):
    # torch applies the factor in double; with x64 on jamp does too, so 2.7 and 0.3 agree.
    enable_x64 = getattr(jax, "enable_x64", None)
    if enable_x64 is None:
        pytest.skip("this jax has no jax.enable_x64 context")
    settings = dict(init_scale=1000.0, growth_factor=2.7, backoff_factor=0.3, growth_interval=2)
    faults = fault_sequence(200, seed=5)
    want_scale, want_tracker, _ = torch_trajectory(torch, settings, faults, X)
    ours = js.GradScaler(**settings)
    with enable_x64(True):
        state = ours.init()
        update = jax.jit(lambda s, f: ours.update(s, ~js.all_finite(f)))
        for i, f in enumerate(faults):
            state = update(state, jnp.float32(f))
            assert ours.get_scale(state) == want_scale[i]
            assert int(state.counter) == want_tracker[i]
