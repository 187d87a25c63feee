"""loss_scaled: skipped steps leave everything as it was, composition with clipping and
MultiSteps, several losses, extra args, reports and get_loss_scale."""

import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jamp.scaler as js

from helpers import assert_trees_close, assert_trees_equal, jaxpr_equations


def make_problem(seed=0):
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(seed), 3)
    params = {"w": jax.random.normal(k1, (5, 3)), "b": jnp.zeros(3)}
    x = jax.random.normal(k2, (8, 5))
    y = jax.random.normal(k3, (8, 3))

    def loss_fn(p, fault=1.0):
        return jnp.mean((x @ p["w"] + p["b"] - y) ** 2) * fault

    return params, loss_fn


# Per step, what the loss is multiplied by. Every transition a scaler makes, each once or
# twice: a fault on the first step, runs of finite steps long enough to grow (interval 3) after
# a fault, inf and nan, two faults in a row, a fault right after growth.
FAULTS = np.array([np.inf, 1, 1, 1, 1, np.nan, np.inf, 1, 1, 1, np.inf, 1], np.float32)


# The default (None, "dynamic") is a GradScaler's state, as test_loss_scale_spellings checks.
LOSS_SCALES = [
    ("grad_scaler", lambda: js.GradScaler(growth_interval=3)),
    ("dynamic", lambda: js.DynamicLossScale(jnp.float32(2.0**15), period=3)),
    ("static", lambda: 1024.0),
]


@pytest.fixture(params=["select", "cond"])
def skip(request):
    """Each way `loss_scaled` can drop a bad step; each must pass the test on its own."""
    return request.param


@pytest.mark.parametrize("name,make_ls", LOSS_SCALES, ids=[n for n, _ in LOSS_SCALES])
def test_fault_injection_skips_leave_params_and_inner_state_untouched(
        name, make_ls, variant, skip):
    params, loss_fn = make_problem()
    inner = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2))
    tx = js.loss_scaled(inner, make_ls(), skip=skip)
    opt_state = tx.init(params)
    ref_state = inner.init(params)  # plain adamw fed only the finite steps' true grads
    ref_params = params

    @variant
    def step(params, opt_state, fault):
        ls = js.get_loss_scale(opt_state)
        grads = jax.grad(lambda p: ls.scale(loss_fn(p, fault)))(params)
        updates, new_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), new_state, updates

    for i, fault in enumerate(FAULTS):
        before_scale = np.asarray(js.get_loss_scale(opt_state).loss_scale)
        new_params, new_state, updates = step(params, opt_state, jnp.float32(fault))
        if np.isfinite(fault):
            g = jax.grad(loss_fn)(ref_params)
            u, ref_state = inner.update(g, ref_state, ref_params)
            ref_params = optax.apply_updates(ref_params, u)
            assert_trees_close(new_state.inner_state, ref_state)
            np.testing.assert_allclose(new_params["w"], ref_params["w"], rtol=1e-6, atol=1e-7)
            assert bool(new_state.last_finite)
        else:
            assert_trees_equal(new_params, params)
            assert_trees_equal(new_state.inner_state, opt_state.inner_state)
            for u in jax.tree_util.tree_leaves(updates):
                assert not np.asarray(u).any()
            assert not bool(new_state.last_finite)
            after = np.asarray(js.get_loss_scale(new_state).loss_scale)
            if name != "static":
                assert after == before_scale / 2
        params, opt_state = new_params, new_state
        # Step counts for logging.
        assert int(opt_state.total_steps) == i + 1
        assert int(opt_state.skipped_steps) == int((~np.isfinite(FAULTS[: i + 1])).sum())
    assert int(opt_state.inner_state[1][0].count) == int(np.isfinite(FAULTS).sum())


def test_clipping_sees_unscaled_grads(variant):
    tx = js.loss_scaled(optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(1.0)),
                        js.DynamicLossScale(jnp.float32(2.0**15)))
    params = {"w": jnp.zeros(2)}
    state = tx.init(params)
    ls = js.get_loss_scale(state)
    update = variant(tx.update)
    small = {"w": jnp.array([0.3, 0.4])}  # norm 0.5: not clipped
    updates, _ = update(ls.scale(small), state, params)
    np.testing.assert_allclose(updates["w"], [-0.3, -0.4], rtol=1e-6)
    big = {"w": jnp.array([3.0, 4.0])}  # norm 5: clipped to norm 1
    updates, _ = update(ls.scale(big), state, params)
    np.testing.assert_allclose(updates["w"], [-0.6, -0.8], rtol=1e-6)


def test_multisteps_recipe_unscales_once_per_window():
    """Apex's accumulation (delay_unscale): MultiSteps outside, loss_scaled inside."""
    params, loss_fn = make_problem()
    k = 4
    tx = optax.MultiSteps(js.loss_scaled(optax.adam(1e-2), js.GradScaler(growth_interval=2)),
                          every_k_schedule=k)
    state = tx.init(params)

    @jax.jit
    def micro_step(params, state, fault):
        ls = js.get_loss_scale(state)
        # Divide by k as Apex's recipe does; MultiSteps averages anyway, so use the mean.
        grads = jax.grad(lambda p: ls.scale(loss_fn(p, fault)))(params)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    scale0 = float(js.get_loss_scale(state).loss_scale)
    ref = optax.adam(1e-2)
    ref_state, ref_params = ref.init(params), params
    # Window 1: finite. The scale holds during the window; the applied step is adam's on the
    # mean of the k unscaled grads.
    for i in range(k):
        params, state = micro_step(params, state, jnp.float32(1.0))
        if i < k - 1:
            assert float(js.get_loss_scale(state).loss_scale) == scale0
    g = jax.grad(loss_fn)(ref_params)
    u, ref_state = ref.update(g, ref_state, ref_params)
    ref_params = optax.apply_updates(ref_params, u)
    np.testing.assert_allclose(params["w"], ref_params["w"], rtol=1e-6)
    inner = state.inner_opt_state
    assert int(inner.total_steps) == 1 and int(inner.skipped_steps) == 0
    # Window 2: one micro-batch overflows -> the whole window is skipped, the scale backs off
    # once, adam's count and moments stay.
    adam_before = inner.inner_state
    params_before = params
    for fault in (1.0, np.inf, 1.0, 1.0):
        params, state = micro_step(params, state, jnp.float32(fault))
    assert_trees_equal(params, params_before)
    inner = state.inner_opt_state
    assert_trees_equal(inner.inner_state, adam_before)
    assert int(inner.total_steps) == 2 and int(inner.skipped_steps) == 1
    assert float(js.get_loss_scale(state).loss_scale) == scale0 / 2


def test_several_losses_have_independent_scales(variant, skip):
    params = {"w": jnp.ones(3)}
    tx = js.loss_scaled(optax.sgd(0.1), js.DynamicLossScale(jnp.float32(2.0**10), period=2),
                        num_losses=3, skip=skip)
    state = tx.init(params)
    # Per step and loss: finite? Each loss overflows on steps of its own, two at once, runs of
    # finite steps long enough (period 2) to grow, and steps where all three are finite.
    plan = np.array([[1, 1, 1], [1, 0, 1], [0, 1, 1], [1, 1, 0], [1, 1, 1], [0, 0, 1],
                     [1, 1, 1], [1, 1, 1], [1, 0, 0], [1, 1, 1]], bool)
    refs = [js.DynamicLossScale(jnp.float32(2.0**10), period=2) for _ in range(3)]

    @variant
    def step(params, state, finite_mask):
        grads = []
        for loss_id in range(3):
            ls = js.get_loss_scale(state, loss_id=loss_id)
            fault = jnp.where(finite_mask[loss_id], 1.0, jnp.inf)
            grads.append(jax.grad(
                lambda p: ls.scale(jnp.sum(p["w"]) * (loss_id + 1) * fault))(params))
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    expected_params = params
    for row in plan:
        params, state = step(params, state, jnp.asarray(row))
        refs = [r.adjust(jnp.asarray(f)) for r, f in zip(refs, row)]
        for loss_id, ref in enumerate(refs):
            got = js.get_loss_scale(state, loss_id=loss_id)
            assert float(got.loss_scale) == float(ref.loss_scale)
            assert int(got.counter) == int(ref.counter)
        if row.all():  # the unscaled grads of the three losses are summed: 1 + 2 + 3
            expected_params = {"w": expected_params["w"] - 0.1 * 6.0}
        np.testing.assert_allclose(params["w"], expected_params["w"], rtol=1e-6)
    assert int(state.skipped_steps) == int((~plan.all(axis=1)).sum())
    # The scales really went different ways.
    assert len({float(js.get_loss_scale(state, i).loss_scale) for i in range(3)}) > 1


def test_several_losses_take_a_scale_per_loss():
    tx = js.loss_scaled(optax.sgd(1.0), [js.GradScaler(), 8.0], num_losses=2)
    state = tx.init({"w": jnp.ones(1)})
    assert isinstance(js.get_loss_scale(state, 0), js.GradScalerState)
    assert float(js.get_loss_scale(state, 1).loss_scale) == 8.0
    with pytest.raises(ValueError, match="loss_id.*\\[0, 2\\).*2"):
        js.get_loss_scale(state, loss_id=2)
    with pytest.raises(ValueError, match="sequence of 2 grad trees.*1"):
        tx.update([{"w": jnp.ones(1)}], state)
    with pytest.raises(ValueError, match="3 entries.*num_losses is 2"):
        js.loss_scaled(optax.sgd(1.0), [1.0, 2.0, 4.0], num_losses=2)


def test_extra_args_reach_the_inner_transformation(variant):
    def init(params):
        return optax.EmptyState()

    def update(updates, state, params=None, *, factor):
        return jax.tree_util.tree_map(lambda u: u * factor, updates), state

    tx = js.loss_scaled(optax.GradientTransformationExtraArgs(init, update), 4.0)
    state = tx.init({"w": jnp.ones(2)})
    updates, _ = variant(tx.update)({"w": jnp.array([4.0, 8.0])}, state, None, factor=3.0)
    np.testing.assert_array_equal(updates["w"], [3.0, 6.0])


def test_non_floating_and_none_leaves_pass_and_never_count(variant):
    tx = js.loss_scaled(optax.identity(), js.GradScaler(init_scale=4.0))
    grads = {"w": jnp.array([4.0, 8.0]), "step": jnp.array(7, jnp.int32),
             "mask": jnp.array([True, False]), "none": None}
    state = tx.init(grads)
    updates, state = variant(tx.update)(grads, state)
    assert bool(state.last_finite) and int(state.skipped_steps) == 0
    np.testing.assert_array_equal(updates["w"], [1.0, 2.0])
    assert updates["step"].dtype == jnp.int32 and int(updates["step"]) == 7
    assert updates["mask"].dtype == jnp.bool_ and updates["none"] is None


def test_mixed_half_and_float_grads(variant):
    params = {"h": jnp.ones(3, jnp.float16), "f": jnp.ones(2, jnp.float32)}

    def loss(p):
        return jnp.sum(p["h"].astype(jnp.float32) ** 2) + jnp.sum(p["f"] ** 2)

    def run(init_scale):
        tx = js.loss_scaled(optax.adam(1e-2), js.GradScaler(init_scale=init_scale))

        @variant
        def step(params, state):
            ls = js.get_loss_scale(state)
            grads = jax.grad(lambda p: ls.scale(loss(p)))(params)
            updates, state = tx.update(grads, state, params)
            return optax.apply_updates(params, updates), state, grads

        return step(params, tx.init(params))

    new_params, state, grads = run(256.0)
    assert grads["h"].dtype == jnp.float16 and grads["f"].dtype == jnp.float32
    assert new_params["h"].dtype == jnp.float16 and new_params["f"].dtype == jnp.float32
    assert bool(state.last_finite)
    assert float(new_params["f"][0]) < 1.0 and float(new_params["h"][0]) < 1.0
    # 2 * 2**20 overflows float16 only: the overflow in one leaf skips the whole step.
    new_params, state, grads = run(2.0**20)
    assert np.isinf(np.asarray(grads["h"])).any() and np.isfinite(np.asarray(grads["f"])).all()
    assert not bool(state.last_finite)
    assert_trees_equal(new_params, params)


def _complex_loss(p):
    return jnp.sum(jnp.real(jnp.conj(p["z"]) * p["z"])) + jnp.sum(p["x"] ** 2)


@pytest.mark.parametrize("loss_scale", ["dynamic", js.DynamicLossScale(jnp.float32(2**15))],
                         ids=["grad_scaler", "dynamic_loss_scale"])
def test_complex_grads_are_unscaled_and_checked(loss_scale, variant):
    params = {"z": jnp.array([1 + 2j, -3j], jnp.complex64), "x": jnp.ones(2)}
    tx = js.loss_scaled(optax.sgd(0.5), loss_scale)
    opt_state = tx.init(params)
    scaled = jax.grad(lambda p: js.get_loss_scale(opt_state).scale(_complex_loss(p)))(params)
    updates, new_state = variant(tx.update)(scaled, opt_state, params)
    sgd = optax.sgd(0.5)
    plain, _ = sgd.update(jax.grad(_complex_loss)(params), sgd.init(params))
    np.testing.assert_allclose(updates["z"], plain["z"], rtol=1e-6)
    assert updates["z"].dtype == jnp.complex64
    # inf in the real part alone (0 imaginary) is not finite.
    bad = {"z": jnp.array([jnp.inf + 0j, 0j], jnp.complex64), "x": jnp.ones(2)}
    updates, skipped = variant(tx.update)(bad, new_state, params)
    assert not bool(skipped.last_finite)
    np.testing.assert_array_equal(updates["z"], np.zeros(2, np.complex64))


@pytest.mark.parametrize("skip", ["select", "cond"])
def test_int_leaf_in_params_passes_through(skip, variant):
    params = {"w": jnp.array([1.0, -2.0]), "step": jnp.array(3, jnp.int32)}
    grads = {"w": jnp.array([0.5, 0.25]), "step": jnp.array(0, jnp.int32)}
    inner = optax.adamw(1e-1)
    tx = js.loss_scaled(inner, js.StaticLossScale(jnp.float32(1.0)), skip=skip)
    opt_state = tx.init(params)
    updates, opt_state = variant(tx.update)(grads, opt_state, params)
    expected, expected_inner = inner.update(grads, inner.init(params), params)
    np.testing.assert_allclose(updates["w"], expected["w"], rtol=1e-6)
    chex.assert_trees_all_close(opt_state.inner_state, expected_inner, rtol=1e-7)
    # A skipped step keeps the inner state's values, in the types the inner update gives.
    bad = {"w": jnp.array([jnp.nan, 0.0]), "step": jnp.array(0, jnp.int32)}
    updates, skipped = variant(tx.update)(bad, opt_state, params)
    assert not bool(skipped.last_finite)
    chex.assert_trees_all_equal(skipped.inner_state,
                                opt_state.inner_state)
    np.testing.assert_array_equal(updates["w"], np.zeros(2))


def test_loss_scale_spellings():
    def first(ls):
        return js.get_loss_scale(js.loss_scaled(optax.sgd(1.0), ls).init({"w": jnp.ones(1)}))

    for spelling in (None, "dynamic"):
        ls = first(spelling)
        assert isinstance(ls, js.GradScalerState)
        assert float(ls.loss_scale) == 65536.0 and ls.growth_interval == 2000
    for number in (128.0, "128.0", np.float32(128.0), jnp.float32(128.0)):
        # A number is Apex's static scale, which counts its finite steps (state_dict's
        # `unskipped`).
        ls = first(number)
        assert isinstance(ls, js.CountingStaticLossScale)
        assert float(ls.loss_scale) == 128.0 and np.asarray(ls.loss_scale).dtype == np.float32
        assert int(ls.counter) == 0
    assert isinstance(first(js.NoOpLossScale()), js.NoOpLossScale)
    dyn = js.DynamicLossScale(jnp.float32(4.0), period=5)
    got = first(dyn)
    assert isinstance(got, js.DynamicLossScale) and got.period == 5
    assert float(got.loss_scale) == 4.0 and int(got.counter) == 0
    assert got.loss_scale is not dyn.loss_scale  # a copy: donating the state leaves dyn alive


@pytest.mark.parametrize("bad,message", [
    ("dyanmic", r"loss_scale must be.*'dyanmic'"),
    (-1.0, r"loss_scale.*> 0.*-1"),
    (0, r"loss_scale.*> 0"),
])
def test_bad_loss_scale_raises(bad, message):
    with pytest.raises(ValueError, match=message):
        js.loss_scaled(optax.sgd(1.0), bad)


@pytest.mark.parametrize("bad", [0, -1, 1.5])
def test_bad_num_losses_raises(bad):
    with pytest.raises(ValueError, match=f"num_losses.*{bad}"):
        js.loss_scaled(optax.sgd(1.0), num_losses=bad)


def test_get_loss_scale_finds_the_wrapper_anywhere():
    params = {"w": jnp.ones(2)}
    wrapped = js.loss_scaled(optax.adam(1e-3), js.GradScaler(init_scale=64.0))
    for tx in (wrapped, optax.chain(optax.scale(2.0), wrapped),
               optax.MultiSteps(wrapped, every_k_schedule=2),
               optax.multi_transform({"a": wrapped}, {"w": "a"})):
        ls = js.get_loss_scale(tx.init(params))
        assert float(ls.loss_scale) == 64.0
        assert float(ls.scale(jnp.float32(2.0))) == 128.0
        np.testing.assert_array_equal(ls.unscale({"g": jnp.full(2, 64.0)})["g"], [1.0, 1.0])
    with pytest.raises(ValueError, match="exactly one loss_scaled state, found 0"):
        js.get_loss_scale(optax.adam(1e-3).init(params))
    two = optax.chain(wrapped, wrapped).init(params)
    with pytest.raises(ValueError, match="found 2"):
        js.get_loss_scale(two)


def test_report_prints_apex_message_on_skips_only(variant, capfd):
    tx = js.loss_scaled(optax.sgd(1.0), js.GradScaler(), report=True)
    params = {"w": jnp.ones(2)}
    state = tx.init(params)
    update = variant(tx.update)
    _, state = update({"w": jnp.array([1.0, 2.0])}, state, params)
    jax.effects_barrier()
    assert "Gradient overflow" not in capfd.readouterr().out
    _, state = update({"w": jnp.array([1.0, jnp.inf])}, state, params)
    jax.effects_barrier()
    out = capfd.readouterr().out
    assert "Gradient overflow.  Skipping step, loss scaler 0 reducing loss scale to 32768.0" in out


def test_report_is_off_by_default(capfd):
    tx = js.loss_scaled(optax.sgd(1.0))
    state = tx.init({"w": jnp.ones(1)})
    tx.update({"w": jnp.array([jnp.nan])}, state)
    jax.effects_barrier()
    assert "Gradient overflow" not in capfd.readouterr().out


def test_update_is_branch_free_with_one_finiteness_check_per_leaf():
    # Two leaves share a shape and dtype ("b", "v"), so they share one reduction.
    params = {"w": jnp.ones((3, 2)), "b": jnp.ones(2), "v": jnp.ones(2),
              "h": jnp.ones(4, jnp.float16)}
    tx = js.loss_scaled(optax.adam(1e-3), js.GradScaler())
    eqns = list(jaxpr_equations(jax.make_jaxpr(tx.update)(params, tx.init(params), params)))
    names = [e.primitive.name for e in eqns]
    assert "cond" not in names and "while" not in names
    # One x - x per floating leaf, one variadic reduction per (shape, dtype) group, one fold;
    # the select and the scale adjustment share them.
    subs = sorted(tuple(e.invars[0].aval.shape) for e in eqns
                  if e.primitive.name == "sub" and e.invars[0].aval.ndim > 0)
    assert subs == [(2,), (2,), (3, 2), (4,)]
    reductions = sorted(len(e.invars) // 2 for e in eqns if e.primitive.name == "reduce")
    assert reductions == [1, 1, 2]  # operands per reduction: (3, 2); (4,) float16; (2,) x 2
    assert [e.primitive.name for e in eqns if e.primitive.name.startswith("reduce_")
            ] == ["reduce_and"]
    assert not [e for e in eqns if e.primitive.name in ("reduce_max", "abs", "is_finite")
                and e.invars[0].aval.ndim > 0]


def test_cond_update_branches_once_on_the_flag():
    params = {"w": jnp.ones((3, 2)), "b": jnp.ones(2)}
    tx = js.loss_scaled(optax.adam(1e-3), js.GradScaler(), skip="cond")
    jaxpr = jax.make_jaxpr(tx.update)(params, tx.init(params), params).jaxpr
    conds = [e for e in jaxpr.eqns if e.primitive.name == "cond"]
    assert len(conds) == 1
    assert conds[0].invars[0].aval.dtype in (jnp.bool_, jnp.int32)  # the finite flag
    assert "select_n" not in [e.primitive.name for e in jaxpr.eqns
                              if e.outvars and e.outvars[0].aval.ndim > 0]


def test_skip_modes_agree_on_a_casting_inner(variant):
    # The inner casts updates to bfloat16, so the skipped branch must return that dtype too.
    inner = optax.chain(optax.adam(1e-2),
                        optax.stateless(lambda u, p: jax.tree_util.tree_map(
                            lambda x: x.astype(jnp.bfloat16), u)))
    params = {"w": jnp.linspace(-1.0, 1.0, 6).reshape(2, 3)}
    results = {}
    scaler = js.GradScaler(init_scale=4.0, growth_interval=2)  # one home for the settings
    for skip in ("select", "cond"):
        tx = js.loss_scaled(inner, scaler, skip=skip)
        update = variant(tx.update)
        state, trail = tx.init(params), []
        for fault in [1.0, np.inf, 1.0, 1.0, np.nan, 1.0]:
            grads = {"w": params["w"] * 4.0 * fault}
            updates, state = update(grads, state, params)
            trail.append((updates, state))
        results[skip] = trail
    # Same decisions and scales; the same updates up to rounding (XLA compiles the inner update
    # on its own inside the cond, and may contract a multiply-add differently).
    for (u_sel, s_sel), (u_cond, s_cond) in zip(results["select"], results["cond"]):
        assert u_cond["w"].dtype == jnp.bfloat16
        assert_trees_equal(js.get_loss_scale(s_sel), js.get_loss_scale(s_cond))
        assert_trees_equal((s_sel.last_finite, s_sel.skipped_steps),
                   (s_cond.last_finite, s_cond.skipped_steps))
        assert_trees_close(u_sel, u_cond)
        assert_trees_close(s_sel.inner_state, s_cond.inner_state)


def test_cond_under_vmap_keeps_each_example_apart():
    # vmap turns the cond into selects; per-example flags still pick per example.
    tx = js.loss_scaled(optax.sgd(1.0), js.GradScaler(init_scale=2.0), skip="cond")
    params = {"w": jnp.ones(3)}
    state = tx.init(params)
    grads = {"w": jnp.array([[2.0, 2.0, 2.0], [2.0, jnp.inf, 2.0], [4.0, 4.0, 4.0]])}
    updates, new_state = jax.vmap(tx.update, in_axes=(0, None, None))(grads, state, params)
    np.testing.assert_array_equal(updates["w"], [[-1.0] * 3, [0.0] * 3, [-2.0] * 3])
    np.testing.assert_array_equal(new_state.last_finite, [True, False, True])
    np.testing.assert_array_equal(js.get_loss_scale(new_state).loss_scale, [2.0, 1.0, 2.0])


def _copied_array_arguments(step, *args):
    """How many non-scalar arguments of the compiled, donated step XLA copies before use."""
    text = jax.jit(step, donate_argnums=(0, 1)).lower(*args).compile().as_text()
    entry = text[text.index("\nENTRY"):]
    arrays = {name for name, shape in re.findall(r"%(\S+) = \w+\[([^\]]*)\]\S* parameter\(",
                                                  entry) if shape}
    return len([src for src in re.findall(r"= \S+ copy\(%([^)\s,]+)\)", entry) if src in arrays])


def test_cond_updates_donated_optimizer_state_in_place():
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
    params = {"w1": jax.random.normal(k1, (16, 32)), "b1": jnp.zeros(32),
              "w2": jax.random.normal(k2, (32, 4))}
    x = jax.random.normal(k3, (8, 16))

    def loss(p):
        return jnp.mean(jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"])

    def make_step(tx, scaled=True):
        def step(params, state):
            ls = js.get_loss_scale(state) if scaled else js.NoOpLossScale()
            grads = jax.grad(lambda p: ls.scale(loss(p)))(params)
            updates, state = tx.update(grads, state, params)
            return optax.apply_updates(params, updates), state
        return step

    adam = optax.adam(1e-3)
    plain = _copied_array_arguments(make_step(adam, scaled=False), params, adam.init(params))
    copies = {}
    for skip in ("select", "cond"):
        tx = js.loss_scaled(adam, skip=skip)
        copies[skip] = _copied_array_arguments(make_step(tx), params, tx.init(params))
    assert copies["cond"] <= plain, copies
    # The reason "cond" exists: with selects, XLA copies the old moments (6 of them here)
    # because the params update still reads them. If a newer XLA stops doing that, the
    # guidance in docs/scaler.md and in loss_scaled's docstring should change with it.
    assert copies["select"] >= 6 > plain, copies


def test_bad_skip_raises():
    with pytest.raises(ValueError, match=r"skip must be one of \['select', 'cond'\], got skip='branch'"):
        js.loss_scaled(optax.sgd(1.0), skip="branch")


def test_init_after_a_donated_state_still_works():
    tx = js.loss_scaled(optax.sgd(1.0), js.GradScaler(init_scale=8.0))
    params = {"w": jnp.ones(2)}
    step = jax.jit(lambda g, s: tx.update(g, s)[1], donate_argnums=(1,))
    step({"w": jnp.ones(2)}, tx.init(params))  # deletes the donated state's buffers
    state = tx.init(params)
    assert float(js.get_loss_scale(state).loss_scale) == 8.0


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_one_bad_element_in_a_large_leaf_skips_the_step(bad):
    # One non-finite element among 65536 (what an fp16 overflow in one unit looks like).
    params = {"w": jnp.zeros((128, 512)), "b": jnp.zeros(512)}
    tx = js.loss_scaled(optax.adam(1e-3), js.GradScaler(init_scale=2.0**16))
    state = tx.init(params)
    grads = {"w": jnp.full((128, 512), 1.0).at[77, 301].set(bad), "b": jnp.ones(512)}
    updates, new_state = jax.jit(tx.update)(grads, state, params)
    assert not bool(new_state.last_finite) and int(new_state.skipped_steps) == 1
    assert_trees_equal(updates, jax.tree_util.tree_map(jnp.zeros_like, params))
    assert_trees_equal(new_state.inner_state, state.inner_state)
    assert float(js.get_loss_scale(new_state).loss_scale) == 2.0**15


def test_counters_saturate_instead_of_wrapping():
    tx = js.loss_scaled(optax.sgd(1.0), 1.0)
    params = {"w": jnp.ones(2)}
    top = jnp.iinfo(jnp.int32).max
    opt_state = tx.init(params)._replace(total_steps=jnp.int32(top), skipped_steps=jnp.int32(top))
    _, opt_state = tx.update({"w": jnp.full(2, jnp.nan)}, opt_state, params)
    assert int(opt_state.total_steps) == top and int(opt_state.skipped_steps) == top
