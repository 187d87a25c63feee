"""`jamp.initialize` on Flax NNX models and optimizers: Apex's opt levels, in place."""

import copy
import pickle
import re
import warnings

import flax.serialization
import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx

import jamp
from helpers import F16, F32, OPT_LEVEL_DTYPES as EXPECTED, assert_trees_equal, rel_err


class Block(nnx.Module):
    """A conv and its batch norm, one level down the module graph."""

    def __init__(self, rngs):
        self.conv = nnx.Conv(8, 8, (3, 3), rngs=rngs)
        self.norm = nnx.BatchNorm(8, rngs=rngs)

    def __call__(self, x):
        return nnx.relu(self.norm(self.conv(x)))


class CNN(nnx.Module):
    """Two convs with batch norms (one inside a submodule) and a head; a Linear named like a
    batch norm, which must be cast like any Linear (batch norms are found by type)."""

    def __init__(self, rngs):
        self.conv = nnx.Conv(1, 8, (3, 3), rngs=rngs)
        self.bn = nnx.BatchNorm(8, rngs=rngs)
        self.block = Block(rngs)
        self.batch_norm = nnx.Linear(8, 16, rngs=rngs)
        self.head = nnx.Linear(16, 10, rngs=rngs)

    def __call__(self, x):
        x = nnx.relu(self.bn(self.conv(x)))
        x = self.block(x).mean((1, 2))
        return self.head(nnx.relu(self.batch_norm(x)))


class MLP(nnx.Module):
    def __init__(self, din, dout, rngs):
        self.hidden = nnx.Linear(din, 16, rngs=rngs)
        self.out = nnx.Linear(16, dout, rngs=rngs)

    def __call__(self, x):
        return self.out(nnx.relu(self.hidden(x)))


X = jnp.asarray(np.random.default_rng(0).normal(size=(16, 8, 8, 1)), jnp.float32)
Y = jnp.arange(16) % 10


def _setup(level, tx=None, **overrides):
    model = CNN(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, tx or optax.adam(1e-2), wrt=nnx.Param)
    return jamp.initialize(model, optimizer, opt_level=level, verbosity=0, **overrides)


def _loss(logits, y):
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), y).mean()


def _step(model, optimizer, x, y):
    """A user's NNX training step; jamp's only part is `jamp.scale_loss`."""
    def loss_fn(model):
        loss = _loss(model(x), y)
        return jamp.scale_loss(loss, optimizer.opt_state), loss

    (_, loss), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
    optimizer.update(model, grads)
    return loss


train_step = nnx.jit(_step)


def _lowered_step(model, optimizer) -> str:
    graphdef, state = nnx.split((model, optimizer))

    def step(state, x, y):
        model, optimizer = nnx.merge(graphdef, state)
        return _step(model, optimizer, x, y), nnx.state((model, optimizer))

    return jax.jit(step).lower(state, X, Y).as_text()


def _matmul_dtypes(text):
    # The operands' type: a linear layer's matmul accumulates its result in float32, which its
    # bias is added to before one rounding.
    found = re.findall(
        r"stablehlo\.(?:convolution|dot_general).*?:\s*\(tensor<(?:[0-9?]+x)*(\w+)>", text)
    assert found, "no matmul or convolution in the lowered program"
    return set(found)


def _kernels(m):
    return [m.conv.kernel, m.block.conv.kernel, m.batch_norm.kernel, m.head.kernel]


def _norm_params(m):
    return [m.bn.scale, m.bn.bias, m.block.norm.scale, m.block.norm.bias]


def _stats(m):
    return [m.bn.mean, m.bn.var, m.block.norm.mean, m.block.norm.var]


def _dtypes(variables):
    return {np.dtype(v.dtype) for v in variables}


def _pure(tree):
    return jax.tree_util.tree_leaves(nnx.as_pure(tree))


def _assert_masters_cast(model, optimizer):
    """The half params are exactly the masters cast; the float32 ones (batch norms') are their
    own masters, to the last bit."""
    params = _pure(nnx.state(model, nnx.Param))
    masters = _pure(jamp.master_params(optimizer.opt_state))
    assert any(p.dtype == F16 for p in params)
    chex.assert_trees_all_equal(
        params, jax.tree.map(lambda p, m: m.astype(p.dtype), params, masters))


@pytest.mark.parametrize("level", sorted(EXPECTED))
def test_each_level_gives_the_documented_dtypes_and_trains(level):
    kernels, norm_params, stats_dtype, masters, matmuls = EXPECTED[level]
    model = CNN(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    same_model, same_optimizer = jamp.initialize(model, optimizer, opt_level=level,
                                                 verbosity=0)
    assert same_model is model and same_optimizer is optimizer   # in place, as Apex
    assert isinstance(model, CNN) and type(model).__name__ == "CNN"
    assert _dtypes(_kernels(model)) == {kernels}
    assert _dtypes(_norm_params(model)) == {norm_params}
    assert _dtypes(_stats(model)) == {stats_dtype}
    if masters is None:
        with pytest.raises(ValueError, match="keeps no master weights"):
            jamp.master_params(optimizer.opt_state)
    else:
        assert {x.dtype for x in _pure(jamp.master_params(optimizer.opt_state))} == {masters}
    # Every conv and matmul of the training step (forward, backward) runs in the level's type.
    assert _matmul_dtypes(_lowered_step(model, optimizer)) == {matmuls}

    initial_mean = np.asarray(model.bn.mean[...])
    losses = []
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # no float32 written into half state
        for _ in range(8):
            losses.append(float(train_step(model, optimizer, X, Y)))
            if masters is not None:  # O2: the params are the masters cast, every step
                _assert_masters_cast(model, optimizer)
    assert np.all(np.isfinite(losses)) and losses[-1] < 0.95 * losses[0], losses
    assert _dtypes(_kernels(model)) == {kernels} and _dtypes(_stats(model)) == {stats_dtype}
    assert not np.allclose(model.bn.mean[...], initial_mean)   # the statistics moved
    assert jamp.state_dict(optimizer.opt_state)["loss_scaler0"]["loss_scale"] == (
        1.0 if level in ("O0", "O3") else 2.0**16)


@pytest.mark.parametrize("level", sorted(EXPECTED))
def test_outputs_match_float32_and_the_model_runs_closed_over(level):
    reference = CNN(nnx.Rngs(0))
    reference.eval()
    model = jamp.initialize(nnx.clone(reference), opt_level=level, verbosity=0)  # inference
    assert isinstance(model, CNN)
    want = reference(X)
    eager = model(X)
    jitted = jax.jit(lambda x: model(x))(X)   # closed over, in eval mode: nothing is written
    assert eager.dtype == jitted.dtype == F32  # O2 and O3 too: Apex's outputs are float32
    assert rel_err(eager, want) < 3e-2 and rel_err(jitted, eager) < 1e-3
    text = jax.jit(lambda x: model(x)).lower(X).as_text()
    assert _matmul_dtypes(text) == {EXPECTED[level][4]}


@pytest.mark.parametrize("level", ["O2", "O3"])
def test_a_set_up_model_pickles_copies_and_clones(level):
    model = jamp.initialize(CNN(nnx.Rngs(0)), opt_level=level, verbosity=0)
    model.eval()
    for other in (pickle.loads(pickle.dumps(model)), copy.deepcopy(model), nnx.clone(model)):
        assert type(other) is type(model) and type(other.bn) is type(model.bn)
        np.testing.assert_array_equal(other(X), model(X))


def test_o2_casts_inputs_and_brings_batch_norm_outputs_back_to_half():
    model = jamp.initialize(CNN(nnx.Rngs(0)), opt_level="O2", verbosity=0)
    seen = {}
    norm_call = type(model.bn).__call__

    def spy(self, x, *args, **kwargs):
        out = norm_call(self, x, *args, **kwargs)
        seen["in"], seen["out"] = x.dtype, out.dtype
        return out

    object.__setattr__(model.bn, "__class__", type("Spy", (type(model.bn),),
                                                   {"__call__": spy}))
    model(X)  # float32 inputs
    assert seen == {"in": F16, "out": F16}  # a float32 batch norm, half in and half out
    assert model.bn.scale.dtype == F32 and isinstance(model.bn, nnx.BatchNorm)


def test_a_skipped_step_leaves_params_masters_and_moments():
    model, optimizer = _setup("O2")
    train_step(model, optimizer, X, Y)
    params = _pure(nnx.state(model, nnx.Param))
    masters = _pure(jamp.master_params(optimizer.opt_state))
    moments = lambda: _pure(nnx.as_pure(optimizer.opt_state).inner_state.inner_state)  # adam's
    adam_state = moments()

    @nnx.jit
    def overflowing_step(model, optimizer):
        grads = nnx.grad(lambda m: jamp.scale_loss(_loss(m(X), Y), optimizer.opt_state))(model)
        optimizer.update(model, jax.tree.map(lambda g: g * jnp.inf, grads))

    overflowing_step(model, optimizer)
    chex.assert_trees_all_equal(params + masters + adam_state, _pure(nnx.state(model, nnx.Param))
                                + _pure(jamp.master_params(optimizer.opt_state)) + moments())
    assert jamp.state_dict(optimizer.opt_state)["loss_scaler0"] == {"loss_scale": 2.0**15,
                                                                    "unskipped": 0}


def test_state_dict_round_trips_with_apex_rules(tmp_path):
    model, optimizer = _setup("O2", loss_scale="dynamic")
    for _ in range(3):
        train_step(model, optimizer, X, Y)
    saved = jamp.state_dict(optimizer.opt_state)
    assert saved == {"loss_scaler0": {"loss_scale": 65536.0, "unskipped": 3}}

    fresh_model, fresh = _setup("O2")
    loaded = jamp.load_state_dict(fresh.opt_state, saved)
    assert loaded is fresh.opt_state   # NNX: loaded in place, into the optimizer's Variables
    assert jamp.state_dict(fresh.opt_state) == saved
    with pytest.warns(UserWarning) as caught:
        jamp.load_state_dict(fresh.opt_state, {**saved, "loss_scaler1": saved["loss_scaler0"]})
    assert [str(w.message) for w in caught] == [
        "Warning: state_dict contains 2 entries, while 1 loss_scalers are used",
        "Skipping loss_scaler[1], since num_losses was set to 1"]
    with pytest.raises(RuntimeError, match='Unexpected key.*"scaler"'):
        jamp.load_state_dict(fresh.opt_state, {"scaler": {}})
    jamp.load_state_dict(fresh.opt_state, {"loss_scaler0": {"loss_scale": 128.0,
                                                            "unskipped": 7}})
    assert float(jamp.scale_loss(jnp.float32(1.0), fresh.opt_state)) == 128.0
    train_step(fresh_model, fresh, X, Y)   # the loaded scale is the one the optimizer uses
    assert jamp.state_dict(fresh.opt_state)["loss_scaler0"]["unskipped"] == 8

    # The whole training state (params, stats, masters, scalers) through flax and orbax.
    state = nnx.state((model, optimizer))
    for restore in ("msgpack", "orbax"):
        other_model, other = _setup("O2")
        target = nnx.state((other_model, other))
        if restore == "msgpack":
            blob = flax.serialization.msgpack_serialize(nnx.to_pure_dict(state))
            nnx.replace_by_pure_dict(target, flax.serialization.msgpack_restore(blob))
        else:
            checkpointer = ocp.StandardCheckpointer()
            checkpointer.save(tmp_path / "state", state)
            checkpointer.wait_until_finished()
            target = checkpointer.restore(tmp_path / "state", target)
        nnx.update((other_model, other), target)
        assert jamp.state_dict(other.opt_state) == saved
        assert_trees_equal(_pure(state), _pure(nnx.state((other_model, other))))
        assert other_model.conv.kernel.dtype == F16


def test_two_models_two_optimizers_three_losses():
    # Seed 002's GAN: the discriminator's two losses (real, fake) and the generator's one,
    # each with its own loss scale; update takes one grad state per loss.
    gen, disc = MLP(2, 4, nnx.Rngs(0)), MLP(4, 1, nnx.Rngs(1))
    opt_g = nnx.Optimizer(gen, optax.adam(1e-3), wrt=nnx.Param)
    opt_d = nnx.Optimizer(disc, optax.adam(1e-3), wrt=nnx.Param)
    models, optimizers = jamp.initialize([gen, disc], [opt_g, opt_d], opt_level="O2",
                                         num_losses=3, verbosity=0)
    assert models == [gen, disc] and optimizers == [opt_g, opt_d]
    real = jax.random.normal(jax.random.key(3), (8, 4))
    z = jax.random.normal(jax.random.key(4), (8, 2))
    bce = lambda logits, target: optax.sigmoid_binary_cross_entropy(
        logits.astype(jnp.float32), jnp.full(logits.shape, target)).mean()

    @nnx.jit
    def step(gen, disc, opt_g, opt_d):
        fake = jax.lax.stop_gradient(gen(z))
        d_real = nnx.grad(lambda d: jamp.scale_loss(bce(d(real), 1.0), opt_d.opt_state, 0))
        d_fake = nnx.grad(lambda d: jamp.scale_loss(bce(d(fake), 0.0), opt_d.opt_state, 1))
        opt_d.update(disc, [d_real(disc), d_fake(disc), None])
        g_grads = nnx.grad(lambda g: jamp.scale_loss(bce(disc(g(z)), 1.0), opt_g.opt_state,
                                                     loss_id=2))(gen)
        opt_g.update(gen, [None, None, g_grads])

    for _ in range(3):
        step(gen, disc, opt_g, opt_d)
    scalers = lambda opt: {k: v["unskipped"] for k, v in jamp.state_dict(opt.opt_state).items()}
    assert scalers(opt_d) == {"loss_scaler0": 3, "loss_scaler1": 3, "loss_scaler2": 0}
    assert scalers(opt_g) == {"loss_scaler0": 0, "loss_scaler1": 0, "loss_scaler2": 3}
    assert int(opt_g.step[...]) == 3 and gen.hidden.kernel.dtype == F16
    _assert_masters_cast(gen, opt_g)
    with pytest.raises(ValueError, match="num_losses=3.*sequence of 3 grad states"):
        opt_g.update(gen, nnx.grad(lambda g: jnp.sum(g(z)))(gen))


def test_list_forms_disabled_and_one_model_with_two_optimizers():
    a, b = MLP(3, 2, nnx.Rngs(0)), MLP(3, 2, nnx.Rngs(1))
    models = jamp.initialize((a, b), opt_level="O2", verbosity=0)   # inference: models only
    assert models == [a, b] and a.hidden.kernel.dtype == b.out.kernel.dtype == F16

    c = MLP(3, 2, nnx.Rngs(2))
    opt = nnx.Optimizer(c, optax.sgd(0.1), wrt=nnx.Param)
    assert jamp.initialize(c, opt, enabled=False) == (c, opt)
    assert jamp.initialize([c], enabled=False) == [c]
    assert c.hidden.kernel.dtype == F32 and type(c) is MLP   # untouched

    # Two optimizers for two parts of one model: the model is given once per optimizer.
    hidden = nnx.All(nnx.Param, nnx.PathContains("hidden"))
    out = nnx.All(nnx.Param, nnx.PathContains("out"))
    opt_h = nnx.Optimizer(c, optax.adam(1e-2), wrt=hidden)
    opt_o = nnx.Optimizer(c, optax.sgd(1e-2), wrt=out)
    models, optimizers = jamp.initialize([c, c], [opt_h, opt_o], opt_level="O2", verbosity=0)
    assert models == [c, c] and c.hidden.kernel.dtype == F16
    assert set(jamp.master_params(opt_h.opt_state)) == {"hidden"}
    assert set(jamp.master_params(opt_o.opt_state)) == {"out"}
    x = jnp.ones((4, 3))
    grads = nnx.grad(lambda m: jamp.scale_loss(jnp.sum(m(x).astype(jnp.float32)),
                                               opt_h.opt_state),
                     argnums=nnx.DiffState(0, hidden))(c)
    before = np.asarray(c.out.kernel[...])
    opt_h.update(c, grads)
    np.testing.assert_array_equal(np.asarray(c.out.kernel[...]), before)


def test_overrides_keep_batchnorm_fp32_at_o3_and_cast_model_outputs():
    model, optimizer = _setup("O3", keep_batchnorm_fp32=True, cast_model_outputs=jnp.float32)
    assert _dtypes(_kernels(model)) == {F16} and _dtypes(_norm_params(model)) == {F32}
    assert _dtypes(_stats(model)) == {F32}
    assert model(X).dtype == F32
    assert _matmul_dtypes(_lowered_step(model, optimizer)) == {"f16"}
    model, _ = _setup("O2", cast_model_type=jnp.bfloat16)
    assert model.head.kernel.dtype == jnp.bfloat16 and model.bn.scale.dtype == F32


def test_prints_apexs_selected_level_block(capsys):
    model = CNN(nnx.Rngs(0))
    jamp.initialize(model, nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param),
                    opt_level="O2", loss_scale=128.0)
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == ("Selected optimization level O2: FP16 training with FP32 batchnorm "
                          "and FP32 master weights.")
    assert printed[-1] == "loss_scale             : 128.0"


class Float64(nnx.Module):
    def __init__(self, dtype=np.float64):
        self.w = nnx.Param(np.ones((2, 2), dtype))

    def __call__(self, x):
        return x @ self.w


def _model_and_optimizer(model=None):
    model = model or MLP(3, 2, nnx.Rngs(0))
    return model, nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)


def _initialized():
    model, optimizer = _model_and_optimizer()
    jamp.initialize(model, optimizer, opt_level="O2", verbosity=0)
    return model, optimizer


M1, O1 = _model_and_optimizer()
M2, O2 = _model_and_optimizer(MLP(5, 2, nnx.Rngs(1)))
M3, O3 = _model_and_optimizer(CNN(nnx.Rngs(0)))


@pytest.mark.parametrize("args,kwargs,error,message", [
    ((M1, O1), dict(opt_level="O4"), RuntimeError, "Unexpected optimization level 'O4'"),
    (([M1, M2], [O1]), {}, ValueError, r"2 model\(s\) but 1 optimizer\(s\)"),
    (([M1, M2], [O2, O1]), {}, ValueError,
     r"optimizers\[0\] was not made for models\[0\].*it fits models\[1\]"),
    ((M1, O3), {}, ValueError, "the optimizer was not made for the model.*fits none"),
    ((M1, optax.adam(1e-3)), {}, TypeError, "must be an nnx.Optimizer"),
    (([M1, MLP], None), {}, TypeError, r"models\[1\] must be an nnx.Module"),
    ((Float64(),), {}, ValueError, r"the model\.w is float64"),
    ((Float64(np.float16),), {}, ValueError, r"the model\.w is float16: .*float32 models"),
    ((M1, nnx.Optimizer(M1, jamp.loss_scaled(optax.adam(1e-3)), wrt=nnx.Param)), {},
     RuntimeError, r"the optimizer is already loss-scaled \(made by jamp\.loss_scaled\)"),
    ((M1, O1), dict(opt_level="O2", keep_batchnorm_fp32=True), ValueError,
     "keep_batchnorm_fp32=True.*the model has no BatchNorm"),
    ((M1, O1), dict(opt_level="O2", loss_scale=-1.0), ValueError, "loss_scale=-1.0"),
    ((M1, O1), dict(opt_level="O2", min_loss_scale=4.0, max_loss_scale=2.0), ValueError,
     "max_loss_scale must be >= min_loss_scale"),
    ((M3, O1), {}, ValueError, "fits none"),
])
def test_bad_input_names_the_value_and_changes_nothing(args, kwargs, error, message):
    state = jax.tree.map(np.asarray, nnx.state((M1, M2, M3, O1, O2, O3)))
    with pytest.raises(error, match=message):
        jamp.initialize(*args, verbosity=0, **kwargs)
    assert [type(m) for m in (M1, M2, M3, M3.bn)] == [MLP, MLP, CNN, nnx.BatchNorm]
    after = nnx.state((M1, M2, M3, O1, O2, O3))
    chex.assert_trees_all_equal_dtypes(state, after)


def test_a_model_or_optimizer_set_up_twice_is_refused():
    model, optimizer = _initialized()
    with pytest.raises(RuntimeError, match="the model was already set up by jamp.initialize"):
        jamp.initialize(model, opt_level="O2", verbosity=0)
    outer = nnx.Sequential(model)
    with pytest.raises(RuntimeError, match=r"its module at \.layers\[0\]"):
        jamp.initialize(outer, opt_level="O2", verbosity=0)
    other = MLP(3, 2, nnx.Rngs(0))
    with pytest.raises(RuntimeError, match="the optimizer was set up by jamp.initialize "
                                           "already: an optimizer is passed through initialize "
                                           "once"):
        jamp.initialize(other, optimizer, opt_level="O2", verbosity=0)


class Noisy(nnx.Module):
    """Dropout whose RNG streams come with the call, as NNX allows."""

    def __init__(self, rngs):
        self.linear = nnx.Linear(4, 4, rngs=rngs)
        self.dropout = nnx.Dropout(0.5)

    def __call__(self, x, rngs, *, scale=2.0):
        return self.dropout(self.linear(x), rngs=rngs) * scale


def test_nnx_objects_passed_to_the_model_are_the_callers():
    model = jamp.initialize(Noisy(nnx.Rngs(0)), opt_level="O2", cast_model_outputs=jnp.float32,
                            verbosity=0)
    rngs = nnx.Rngs(dropout=1)
    x = jnp.ones((2, 4))
    first, second = model(x, rngs), model(x, rngs)
    assert first.dtype == F32 and not np.array_equal(first, second)   # a new mask each call
    assert int(rngs.dropout.count[...]) == 2    # the caller's Rngs advanced, not a cast copy


def test_an_optimizer_with_multisteps_accumulates_under_the_loss_scale():
    model = MLP(3, 2, nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.MultiSteps(optax.sgd(0.1), every_k_schedule=2),
                              wrt=nnx.Param)
    # A static scale, so that no micro-step of this toy loss overflows float16.
    model, optimizer = jamp.initialize(model, optimizer, opt_level="O2", loss_scale=128.0,
                                       verbosity=0)
    x, y = jnp.ones((4, 3)), jnp.zeros((4, 2))

    def scaled_loss(model):
        return jamp.scale_loss(jnp.mean((model(x).astype(jnp.float32) - y) ** 2),
                               optimizer.opt_state)

    kernels = [np.asarray(model.out.kernel[...])]
    for _ in range(3):
        optimizer.update(model, nnx.grad(scaled_loss)(model))
        kernels.append(np.asarray(model.out.kernel[...]))
    moved = [not np.array_equal(a, b) for a, b in zip(kernels, kernels[1:])]
    assert moved == [False, True, False]  # one update per two micro-steps
    assert model.out.kernel.dtype == F16
    assert jamp.state_dict(optimizer.opt_state)["loss_scaler0"]["unskipped"] == 3
