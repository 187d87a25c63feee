"""`jamp.initialize` on Flax linen models: Apex's opt levels, masters, loss scales, state dicts."""

import re

import flax.linen as nn
import flax.serialization
import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

import jamp
from helpers import F16, F32, OPT_LEVEL_DTYPES as EXPECTED


class CNN(nn.Module):
    """Two convs with batch norms (one under a custom name) and a dense head; a Dense named
    like a batch norm, which must be cast like any Dense."""

    @nn.compact
    def __call__(self, x, train=True):
        x = nn.Conv(8, (3, 3))(x)
        x = nn.BatchNorm(use_running_average=not train)(x)
        x = nn.relu(x)
        x = nn.Conv(8, (3, 3))(x)
        x = nn.BatchNorm(use_running_average=not train, name="norm")(x)
        x = nn.relu(x).mean((1, 2))
        x = nn.Dense(16, name="BatchNorm_9")(x)
        return nn.Dense(10)(nn.relu(x))


MODEL = CNN()
X = jnp.asarray(np.random.default_rng(0).normal(size=(8, 8, 8, 1)), jnp.float32)
Y = jnp.arange(8) % 10
VARIABLES = MODEL.init(jax.random.key(0), X)


def _setup(level, tx=None, **overrides):
    return jamp.initialize(MODEL.apply, VARIABLES, tx or optax.adam(1e-2), opt_level=level,
                           verbosity=0, **overrides)


def _step_fn(apply_fn, tx):
    def loss_fn(params, stats, opt_state, x, y):
        logits, updates = apply_fn({"params": params, "batch_stats": stats}, x,
                                   mutable=["batch_stats"])
        loss = optax.softmax_cross_entropy_with_integer_labels(
            logits.astype(jnp.float32), y).mean()
        return jamp.scale_loss(loss, opt_state), (loss, updates["batch_stats"])

    def step(params, stats, opt_state, x, y):
        grads, (loss, stats) = jax.grad(loss_fn, has_aux=True)(params, stats, opt_state, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), stats, opt_state, loss

    return jax.jit(step)


def _matmul_dtypes(text):
    # The operands' type: a linear layer's matmul accumulates its result in float32, which its
    # bias is added to before one rounding.
    found = re.findall(
        r"stablehlo\.(?:convolution|dot_general).*?:\s*\(tensor<(?:[0-9?]+x)*(\w+)>", text)
    assert found, "no matmul or convolution in the lowered program"
    return set(found)


@pytest.mark.parametrize("level", sorted(EXPECTED))
def test_each_level_gives_the_documented_dtypes_and_trains(level):
    kernels, norm_params, stats_dtype, masters, matmuls = EXPECTED[level]
    apply_fn, variables, tx = _setup(level)
    params, stats = variables["params"], variables["batch_stats"]
    assert params["Conv_0"]["kernel"].dtype == kernels
    assert params["BatchNorm_9"]["kernel"].dtype == kernels  # a Dense, whatever its name
    assert params["BatchNorm_0"]["scale"].dtype == norm_params
    assert params["norm"]["bias"].dtype == norm_params  # a BatchNorm, whatever its name
    assert stats["norm"]["var"].dtype == stats_dtype
    opt_state = tx.init(params)
    if masters is None:
        with pytest.raises(ValueError, match="keeps no master weights"):
            jamp.master_params(opt_state)
    else:
        masters_tree = jamp.master_params(opt_state)
        assert {x.dtype for x in jax.tree_util.tree_leaves(masters_tree)} == {masters}
    step = _step_fn(apply_fn, tx)
    text = step.lower(params, stats, opt_state, X, Y).as_text()
    assert _matmul_dtypes(text) == {matmuls}  # forward and backward alike
    losses = []
    for _ in range(8):
        params, new_stats, opt_state, loss = step(params, stats, opt_state, X, Y)
        assert jax.tree_util.tree_structure(new_stats) == jax.tree_util.tree_structure(stats)
        assert {x.dtype for x in jax.tree_util.tree_leaves(new_stats)} == {stats_dtype}
        stats = new_stats
        losses.append(float(loss))
        if masters is not None:  # the half params are the masters cast, after every step
            jax.tree_util.tree_map(
                lambda p, m: np.testing.assert_array_equal(p, m.astype(p.dtype)),
                params, jamp.master_params(opt_state))
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0]


def test_masters_unscale_in_float32_so_small_half_grads_survive():
    # A true grad of 1e-8 is below float16's smallest subnormal; scaled by 2**16 it is
    # representable, and unscaled in float32 (not float16) it reaches the master intact.
    model = nn.Dense(1, use_bias=False)
    variables = model.init(jax.random.key(1), jnp.ones((1, 1)))
    variables = {"params": {"kernel": jnp.full((1, 1), 1e-3)}}
    apply_fn, variables, tx = jamp.initialize(model.apply, variables, optax.sgd(1.0),
                                              opt_level="O2", verbosity=0)
    opt_state = tx.init(variables["params"])
    loss = lambda p: jamp.scale_loss(
        1e-8 * apply_fn({"params": p}, jnp.ones((1, 1))).astype(jnp.float32).sum(), opt_state)
    grads = jax.grad(loss)(variables["params"])
    assert grads["kernel"].dtype == F16 and float(grads["kernel"][0, 0]) != 0.0
    start = float(jamp.master_params(opt_state)["kernel"][0, 0])
    _, opt_state = tx.update(grads, opt_state, variables["params"])
    moved = start - float(jamp.master_params(opt_state)["kernel"][0, 0])
    np.testing.assert_allclose(moved, 1e-8, rtol=2e-3)  # float16 rounding of the scaled grad
    assert float(np.float16(1e-8)) == 0.0  # what unscaling in float16 would have given


def test_clipping_in_the_chain_sees_unscaled_float32_master_grads():
    seen = []

    def spy(updates, state, params=None):
        seen.append(jax.tree_util.tree_map(lambda g: g.dtype, updates))
        return updates, state

    tx = optax.chain(optax.clip_by_global_norm(0.5), optax.GradientTransformation(
        lambda p: optax.EmptyState(), spy), optax.sgd(1.0))
    apply_fn, variables, tx = _setup("O2", tx=tx)
    params = variables["params"]
    opt_state = tx.init(params)
    grads = jax.tree_util.tree_map(lambda p: jnp.full(p.shape, 2.0**15, p.dtype), params)
    _, opt_state = jax.jit(tx.update)(grads, opt_state, params)  # true grads: all 0.5
    assert {d for tree in seen for d in jax.tree_util.tree_leaves(tree)} == {F32}
    before = jamp.master_params(tx.init(params))
    step = jax.tree_util.tree_map(lambda a, b: a - b, before, jamp.master_params(opt_state))
    np.testing.assert_allclose(optax.tree.norm(step), 0.5, rtol=1e-5)


def test_loss_scales_follow_the_level_and_the_overrides():
    for level, scale in [("O0", 1.0), ("O1", 2.0**16), ("O2", 2.0**16), ("O3", 1.0)]:
        _, variables, tx = _setup(level)
        assert jamp.state_dict(tx.init(variables["params"])) == {
            "loss_scaler0": {"loss_scale": scale, "unskipped": 0}}
    _, variables, tx = _setup("O3", loss_scale="dynamic", max_loss_scale=2.0**17,
                              min_loss_scale=2.0**15)
    ls = jamp.get_loss_scale(tx.init(variables["params"]))
    assert float(ls.loss_scale) == 2.0**16 and ls.max_loss_scale == 2.0**17
    assert float(ls.min_loss_scale) == 2.0**15
    _, variables, tx = _setup("O2", loss_scale="128.0")
    assert float(jamp.get_loss_scale(tx.init(variables["params"])).loss_scale) == 128.0


def test_num_losses_with_masters_around():
    _, variables, tx = _setup("O2", num_losses=3)
    params = variables["params"]
    opt_state = tx.init(params)
    assert float(jamp.get_loss_scale(opt_state, loss_id=2).loss_scale) == 2.0**16
    grads = jax.tree_util.tree_map(lambda p: jnp.ones_like(p) * 2.0**10, params)
    bad = jax.tree_util.tree_map(lambda g: g * jnp.inf, grads)
    _, opt_state = jax.jit(tx.update)([grads, bad, None], opt_state, params)
    sd = jamp.state_dict(opt_state)
    assert sd == {"loss_scaler0": {"loss_scale": 2.0**16, "unskipped": 1},
                  "loss_scaler1": {"loss_scale": 2.0**15, "unskipped": 0},
                  "loss_scaler2": {"loss_scale": 2.0**16, "unskipped": 0}}


def test_state_dict_round_trips_with_apex_rules(tmp_path):
    _, variables, tx = _setup("O2", num_losses=2)
    params = variables["params"]
    opt_state = tx.init(params)
    saved = {"loss_scaler0": {"loss_scale": 1024.0, "unskipped": 7},
             "loss_scaler1": {"loss_scale": 8.0, "unskipped": 1}}
    loaded = jamp.load_state_dict(opt_state, saved)
    assert jamp.state_dict(loaded) == saved
    with pytest.warns(UserWarning) as warned:
        jamp.load_state_dict(opt_state, {**saved, "loss_scaler2": saved["loss_scaler0"]})
    assert [str(w.message) for w in warned] == [
        "Warning: state_dict contains 3 entries, while 2 loss_scalers are used",
        "Skipping loss_scaler[2], since num_losses was set to 2"]
    with pytest.raises(RuntimeError, match='Unexpected key.*"scaler"'), \
            pytest.warns(UserWarning, match="contains 1 entries, while 2"):
        jamp.load_state_dict(opt_state, {"scaler": {}})
    # The whole training state (half params, float32 masters, scales) round-trips.
    state = {"params": params, "opt_state": loaded}
    restored = flax.serialization.from_bytes(
        {"params": params, "opt_state": tx.init(params)}, flax.serialization.to_bytes(state))
    assert jamp.state_dict(restored["opt_state"]) == saved
    chex.assert_trees_all_equal(restored, state)
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(tmp_path / "ckpt", state)
        ckpt.wait_until_finished()
        back = ckpt.restore(tmp_path / "ckpt", jax.tree_util.tree_map(
            ocp.utils.to_shape_dtype_struct, {"params": params, "opt_state": tx.init(params)}))
    assert jamp.master_params(back["opt_state"])["Conv_0"]["kernel"].dtype == F32
    chex.assert_trees_all_equal(back, state)


class Batch:
    """Seed 002's custom batch type: it knows how to cast itself."""

    def __init__(self, x):
        self.x = x

    def to(self, dtype):
        return Batch(self.x.astype(dtype))


class Reads(nn.Module):
    @nn.compact
    def __call__(self, batch, pair, raw):
        self.sow("intermediates", "dtypes", (batch.x.dtype, pair[0].dtype, raw.dtype))
        return nn.Dense(2)(batch.x)


def test_o2_casts_inputs_as_apex_does():
    model = Reads()
    args = (Batch(jnp.ones((1, 3))), (jnp.ones(2), jnp.arange(2)), np.ones(2, np.float32))
    variables = model.init(jax.random.key(0), *args)
    apply_fn, variables = jamp.initialize(model.apply, variables, opt_level="O2",
                                          verbosity=0, cast_model_outputs=jnp.float32)
    out, sown = apply_fn(variables, *args, mutable=["intermediates"])
    assert sown["intermediates"]["dtypes"][0] == (F16, F16, np.dtype(np.float32))
    assert out.dtype == F32  # cast_model_outputs, at any level


def test_list_forms_and_disabled():
    a, b = nn.Dense(2), nn.Dense(3)
    va, vb = a.init(jax.random.key(0), jnp.ones((1, 2))), b.init(jax.random.key(1),
                                                                 jnp.ones((1, 2)))
    fns, vs, txs = jamp.initialize([a.apply, b.apply], [va, vb],
                                   [optax.sgd(1.0), optax.adam(1.0)], opt_level="O2",
                                   verbosity=0)
    assert isinstance(fns, list) and isinstance(vs, list) and len(txs) == 2
    fn, v, tx = jamp.initialize(a.apply, va, optax.sgd(1.0), opt_level="O1", verbosity=0)
    assert callable(fn) and isinstance(tx, optax.GradientTransformation)
    fn, v, txs = jamp.initialize(a.apply, va, [optax.sgd(1.0), optax.sgd(0.1)], verbosity=0)
    assert len(txs) == 2
    same = jamp.initialize(a.apply, va, optax.sgd(1.0), enabled=False)
    assert same[0] == a.apply and same[1] is va


def test_prints_apexs_selected_level_block(capsys):
    jamp.initialize(MODEL.apply, VARIABLES, opt_level="O2", loss_scale=128.0)
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == ("Selected optimization level O2: FP16 training with FP32 batchnorm "
                          "and FP32 master weights.")
    assert "Defaults for this optimization level are:" in printed
    assert "After processing overrides, optimization options are:" in printed
    assert printed[-1] == "loss_scale             : 128.0"
    assert "loss_scale             : dynamic" in printed


@pytest.mark.parametrize("make,error,message", [
    (lambda: jamp.initialize(MODEL.apply, VARIABLES, opt_level="O4", verbosity=0),
     RuntimeError, "Unexpected optimization level 'O4'"),
    (lambda: jamp.initialize([MODEL.apply, MODEL.apply], [VARIABLES], verbosity=0),
     ValueError, "2 apply function.*1 set"),
    (lambda: jamp.initialize(lambda v, x: x, VARIABLES, verbosity=0),
     TypeError, "Flax linen model's apply function"),
    (lambda: jamp.initialize(nn.Dense(2).apply, {"params": {"kernel": np.ones((2, 2),
                                                                             np.float64)}},
                             verbosity=0),
     ValueError, r"variables\['params'\]\['kernel'\] is float64"),
    (lambda: jamp.initialize(nn.Dense(2).apply, {"params": {"kernel": jnp.ones((2, 2))}},
                             opt_level="O2", keep_batchnorm_fp32=True, verbosity=0),
     ValueError, "keep_batchnorm_fp32=True.*no BatchNorm"),
    (lambda: jamp.initialize(MODEL.apply, VARIABLES, opt_level="O2", loss_scale=-1.0,
                             verbosity=0),
     ValueError, "loss_scale=-1.0"),
    (lambda: jamp.initialize(MODEL.apply, VARIABLES, "not an optimizer", verbosity=0),
     TypeError, "txs must be an optax GradientTransformation or optax.MultiSteps"),
])
def test_bad_input_names_the_value(make, error, message):
    with pytest.raises(error, match=message):
        make()


def test_an_optimizer_initialized_with_other_params_is_refused():
    _, variables, tx = _setup("O2")
    with pytest.raises(ValueError, match=r"params\['BatchNorm_9'\]\['bias'\] is float32 "
                                         r"\(expected float16\).*initialize it with the params"):
        tx.init(VARIABLES["params"])  # the float32 originals, not the returned half params


@pytest.mark.parametrize("level", ["O3", "O1"])
def test_optimizer_state_keeps_its_types_so_steps_scan(level):
    model = nn.Dense(4)
    variables = model.init(jax.random.key(0), jnp.ones((2, 3)))
    apply_fn, variables, tx = jamp.initialize(model.apply, variables, optax.adam(1e-3),
                                              opt_level=level, verbosity=0)
    params = variables["params"]
    opt_state = tx.init(params)

    def step(carry, _):
        params, opt_state = carry
        grads = jax.grad(lambda p: jamp.scale_loss(
            apply_fn({"params": p}, jnp.ones((2, 3))).astype(jnp.float32).sum(), opt_state))(
            params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), None

    (new_params, new_state), _ = jax.lax.scan(step, (params, opt_state), length=3)
    chex.assert_trees_all_equal_dtypes(new_state, opt_state)
    chex.assert_trees_all_equal_dtypes(new_params, params)


def test_o2_state_reads_its_counters_like_the_other_levels():
    _, variables, tx = _setup("O2")
    params = variables["params"]
    opt_state = tx.init(params)
    bad = jax.tree_util.tree_map(lambda p: jnp.full(p.shape, jnp.inf, p.dtype), params)
    _, opt_state = jax.jit(tx.update)(bad, opt_state, params)
    assert int(opt_state.skipped_steps) == 1 and int(opt_state.total_steps) == 1
    assert not bool(opt_state.last_finite)
    assert float(opt_state.loss_scale.loss_scale) == 2.0**15


def test_a_loss_scaled_for_several_optimizers_is_refused():
    _, [va, vb], [ta, tb] = jamp.initialize([MODEL.apply, MODEL.apply], [VARIABLES, VARIABLES],
                                            [optax.sgd(1.0), optax.sgd(1.0)], opt_level="O2",
                                            verbosity=0)
    states = [ta.init(va["params"]), tb.init(vb["params"])]
    with pytest.raises(ValueError, match="scaled once per optimizer.*multi_transform"):
        jamp.scale_loss(jnp.float32(1.0), states)
    assert float(jamp.scale_loss(jnp.float32(1.0), states[:1])) == 2.0**16



@pytest.mark.parametrize("name,use", [
    ("scale_loss", lambda state: jamp.scale_loss(jnp.float32(1.0), state)),
    ("state_dict", jamp.state_dict),
    ("load_state_dict", lambda state: jamp.load_state_dict(
        state, {"loss_scaler0": {"loss_scale": 2.0, "unskipped": 0}})),
])
def test_a_plain_optax_state_is_refused_by_name_with_the_way_to_a_loss_scaled_one(name, use):
    plain = optax.adam(1e-3).init({"w": jnp.ones(2)})
    with pytest.raises(ValueError, match=f"^{name} got an optimizer state holding no loss "
                                         r"scale.*jamp\.initialize.*jamp\.loss_scaled"):
        use(plain)


@pytest.mark.parametrize("level,overrides", [("O0", {}), ("O3", {}),
                                             ("O2", {"loss_scale": 128.0})])
def test_a_static_scale_counts_unskipped_steps_and_skips_a_non_finite_one(
        level, overrides, variant):
    # Apex counts every unskipped step at a static scale; jamp also skips a step whose grads
    # hold inf or nan there (where Apex would apply it): the step is not counted.
    model = nn.Dense(2)
    _, variables, tx = jamp.initialize(model.apply, model.init(jax.random.key(0), jnp.ones((1, 3))),
                                       optax.sgd(0.5), opt_level=level, verbosity=0, **overrides)
    params = variables["params"]
    opt_state = tx.init(params)
    scale = float(jamp.get_loss_scale(opt_state).loss_scale)
    update = variant(tx.update)
    grads = jax.tree_util.tree_map(lambda p: jnp.full(p.shape, scale, p.dtype), params)
    bad = jax.tree_util.tree_map(lambda g: g.at[0].set(jnp.nan), grads)
    history = []
    for g in (grads, grads, grads, bad, grads):
        updates, opt_state = update(g, opt_state, params)
        params = optax.apply_updates(params, updates)
        history.append((jamp.state_dict(opt_state)["loss_scaler0"], params["bias"]))
    assert [entry for entry, _ in history] == [
        {"loss_scale": scale, "unskipped": n} for n in (1, 2, 3, 3, 4)]
    np.testing.assert_array_equal(history[3][1], history[2][1])  # the nan step left params
    assert np.all(np.isfinite(np.asarray(params["bias"], np.float32)))
    assert int(opt_state.skipped_steps) == 1 and int(opt_state.total_steps) == 5
    loaded = jamp.load_state_dict(opt_state, {"loss_scaler0": {"loss_scale": scale,
                                                               "unskipped": 7}})
    assert jamp.state_dict(loaded) == {"loss_scaler0": {"loss_scale": scale, "unskipped": 7}}


# -- a second pass through initialize ------------------------------------------------------------

_SMALL = nn.Dense(2)
_SMALL_VARIABLES = _SMALL.init(jax.random.key(0), jnp.ones((1, 3)))


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_a_second_pass_of_the_returned_optimizer_or_apply_function_is_refused(level):
    # Apex: "A given optimizer should only be passed through amp.initialize once."
    apply_fn, variables, tx = jamp.initialize(_SMALL.apply, _SMALL_VARIABLES, optax.sgd(0.1),
                                              opt_level=level, verbosity=0)
    for given in (variables, _SMALL_VARIABLES):
        with pytest.raises(RuntimeError, match=r"^txs was set up by jamp\.initialize already.*"
                                               r"once.*your own optax optimizer"):
            jamp.initialize(_SMALL.apply, given, tx, opt_level=level, verbosity=0)
    with pytest.raises(RuntimeError, match=r"^apply_fns was returned by jamp\.initialize "
                                           rf"\(opt level {level}\).*model\.apply"):
        jamp.initialize(apply_fn, _SMALL_VARIABLES, optax.sgd(0.1), opt_level=level,
                        verbosity=0)
    with pytest.raises(RuntimeError, match=r"txs\[1\] was set up by jamp\.initialize"):
        jamp.initialize(_SMALL.apply, _SMALL_VARIABLES, [optax.sgd(0.1), tx], verbosity=0)


def test_returned_half_variables_are_refused_and_float32_ones_are_harmless():
    _, half, _ = jamp.initialize(_SMALL.apply, _SMALL_VARIABLES, optax.sgd(0.1),
                                 opt_level="O2", verbosity=0)
    # Apex's float32 check: a model comes to initialize in float32.
    with pytest.raises(ValueError, match=r"variables\['params'\]\['bias'\] is float16.*float32 "
                                         r"variables.*returned these already"):
        jamp.initialize(_SMALL.apply, half, optax.sgd(0.1), opt_level="O2", verbosity=0)
    # O1's variables are the float32 originals: set up again, they train exactly as before.
    runs = []
    for variables in (_SMALL_VARIABLES, None):
        _, variables, tx = jamp.initialize(_SMALL.apply, variables or runs[0][0],
                                           optax.sgd(0.1), opt_level="O1", verbosity=0)
        opt_state = tx.init(variables["params"])
        scale = jamp.get_loss_scale(opt_state).loss_scale
        grads = jax.tree_util.tree_map(lambda p: jnp.full_like(p, 0.5 * scale),
                                       variables["params"])
        updates, _ = tx.update(grads, opt_state, variables["params"])
        runs.append((variables, updates))
    chex.assert_trees_all_equal(runs[0], runs[1])
    np.testing.assert_allclose(runs[1][1]["bias"], [-0.05, -0.05])  # one unscaled SGD step


def test_an_optimizer_already_loss_scaled_is_refused_where_it_is_wrapped_again():
    scaled = jamp.loss_scaled(optax.sgd(0.1))
    with pytest.raises(RuntimeError, match=r"^txs is already loss-scaled \(made by "
                                           r"jamp\.loss_scaled\).*plain optax optimizer"):
        jamp.initialize(_SMALL.apply, _SMALL_VARIABLES, scaled, verbosity=0)
    with pytest.raises(ValueError, match=r"^loss_scaled got an optimizer that already scales "
                                         r"losses"):
        jamp.loss_scaled(scaled)
    # Inside a chain (or any wrapper), its state gives it away when the state is made.
    params = _SMALL_VARIABLES["params"]
    nested = optax.chain(optax.clip_by_global_norm(1.0), scaled)
    with pytest.raises(ValueError, match=r"its state holds a loss scale already"):
        jamp.loss_scaled(nested).init(params)
    _, _, tx = jamp.initialize(_SMALL.apply, _SMALL_VARIABLES, nested, verbosity=0)
    with pytest.raises(ValueError, match=r"its state holds a loss scale already"):
        tx.init(params)


# -- optax.MultiSteps: gradient accumulation under the loss scale --------------------------------


def test_multisteps_accumulates_unscaled_grads_and_a_skipped_micro_step_leaves_it():
    # The loss scale wraps the accumulation: each micro-step's grads are unscaled and checked
    # before they are accumulated, so a scale change between micro-steps is harmless and an
    # overflowing micro-step is dropped whole. Held against optax's own MultiSteps fed the
    # finite micro-steps' true grads.
    every = 3
    accumulating = optax.MultiSteps(optax.adam(1e-2), every_k_schedule=every)
    _, variables, tx = jamp.initialize(_SMALL.apply, _SMALL_VARIABLES, accumulating,
                                       opt_level="O0", loss_scale="dynamic", verbosity=0)
    _, _, same = jamp.initialize(_SMALL.apply, _SMALL_VARIABLES,
                                 accumulating.gradient_transformation(), opt_level="O0",
                                 loss_scale="dynamic", verbosity=0)
    assert (jax.tree_util.tree_structure(tx.init(variables["params"]))
            == jax.tree_util.tree_structure(same.init(variables["params"])))
    params = reference_params = variables["params"]
    reference = optax.MultiSteps(optax.adam(1e-2), every_k_schedule=every)
    opt_state, reference_state = tx.init(params), reference.init(params)
    rng = np.random.default_rng(0)
    true_grads = [jax.tree_util.tree_map(
        lambda p: jnp.asarray(rng.normal(size=p.shape), jnp.float32), params) for _ in range(7)]
    update = jax.jit(tx.update)
    applied = []
    for i, g in enumerate(true_grads):
        scale = jamp.get_loss_scale(opt_state).loss_scale
        scaled = jax.tree_util.tree_map(lambda x: x * scale, g)
        if i == 1:  # an overflowing micro-step inside the first window
            scaled = jax.tree_util.tree_map(lambda x: x.at[0].set(jnp.inf), scaled)
            before = opt_state
        updates, opt_state = update(scaled, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        if i == 1:
            chex.assert_trees_all_equal(opt_state.inner_state,
                                        before.inner_state)  # accumulator and mini_step untouched
            assert float(jamp.get_loss_scale(opt_state).loss_scale) == 2.0**15
        else:
            ref_updates, reference_state = reference.update(g, reference_state,
                                                            reference_params)
            reference_params = optax.apply_updates(reference_params, ref_updates)
            chex.assert_trees_all_equal(new_params, reference_params)
        applied.append(not np.array_equal(new_params["kernel"], params["kernel"]))
        params = new_params
    # One update per `every` finite micro-steps: after micro-steps 0, 2, 3 and 4, 5, 6.
    assert applied == [False, False, False, True, False, False, True]
    assert jamp.state_dict(opt_state)["loss_scaler0"] == {"loss_scale": 2.0**15, "unskipped": 5}
