"""Autocast through every higher-order primitive and transform: nested jit, scan, while/fori,
cond/switch, checkpoint, custom_jvp, custom_vjp, shard_map, vmap and differentiation."""


import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

import jamp

from helpers import (BF16, F32, W, X, eqn_dtypes, jaxpr_eqns, low_matmul, lowered_op_types,
                     rel_err)


def cpu(f, **kw):
    return jamp.autocast(f, device_type="cpu", **kw)


def dot_types(f, *args):
    return lowered_op_types(f, *args, op="dot_general")


def test_nested_jit_is_kept_and_transformed(variant):
    @jax.jit
    def layer(x, w):
        return jnp.tanh(x @ w)

    f = cpu(lambda x, w: layer(x, w) * layer(2.0 * x, w), cast_outputs=False)
    jaxpr = jax.make_jaxpr(f)(X, W)
    jits = jaxpr_eqns(jaxpr, "jit")
    assert len(jits) == 2 and all(e.params["name"] == "layer" for e in jits)
    assert [eqn_dtypes(e)[1] for e in jits] == [["bfloat16"], ["bfloat16"]]
    # Both calls have the same input types: one transformed body serves both.
    assert jits[0].params["jaxpr"] is jits[1].params["jaxpr"]
    assert variant(f)(X, W).dtype == BF16
    assert set(dot_types(f, X, W)) == {("bfloat16",) * 3}
    np.testing.assert_allclose(f(X, W).astype(F32), np.tanh(X @ W) * np.tanh(2 * X @ W),
                               rtol=3e-2, atol=3e-2)


def test_scan_keeps_carry_dtype(variant):
    def f(x, w):
        def step(c, xs):
            c = jnp.tanh(c @ w + xs)
            return c, c.sum()
        return lax.scan(step, x[0], x)

    g = cpu(f, cast_outputs=False)
    carry, ys = variant(g)(X, W)
    assert carry.dtype == F32          # carries keep the traced type
    scans = jaxpr_eqns(jax.make_jaxpr(g)(X, W), "scan")
    assert len(scans) == 1
    assert dot_types(g, X, W) == [("bfloat16",) * 3]
    want_c, want_ys = f(X, W)
    assert rel_err(carry, want_c) < 3e-2 and rel_err(ys, want_ys) < 3e-2


def test_while_and_fori(variant):
    def f(x, w):
        def body(c):
            i, v = c
            return i + 1, jnp.tanh(v @ w)
        _, v = lax.while_loop(lambda c: c[0] < 3, body, (0, x))
        return lax.fori_loop(0, 2, lambda i, v: jnp.sin(v @ w), v)

    g = cpu(f, cast_outputs=False)
    out = variant(g)(X, W)
    # Both bodies lower their carry (tanh and sin of a lowered matmul): the carries settle in
    # bfloat16, as a Python loop over the same ops under torch's autocast would.
    assert out.dtype == BF16
    jaxpr = jax.make_jaxpr(g)(X, W)
    # fori_loop with static bounds traces to a scan.
    assert len(jaxpr_eqns(jaxpr, "while")) == len(jaxpr_eqns(jaxpr, "scan")) == 1
    loops = jaxpr_eqns(jaxpr, "while") + jaxpr_eqns(jaxpr, "scan")
    assert [eqn_dtypes(e)[1][-1] for e in loops] == ["bfloat16", "bfloat16"]
    assert dot_types(g, X, W) == [("bfloat16",) * 3] * 2
    assert rel_err(out, f(X, W)) < 3e-2
    # fori_loop with static bounds is a scan and differentiable.
    h = cpu(lambda x, w: lax.fori_loop(0, 2, lambda i, v: jnp.sin(v @ w), x).sum())
    grads = jax.grad(h, argnums=1)(X, W)
    want = jax.grad(lambda x, w: lax.fori_loop(0, 2, lambda i, v: jnp.sin(v @ w), x).sum(),
                    argnums=1)(X, W)
    assert grads.dtype == F32 and rel_err(grads, want) < 3e-2


def test_cond_and_switch(variant):
    def f(x, w, k):
        a = lax.cond(k > 0, lambda v: jnp.tanh(v @ w), lambda v: v * 2.0, x)
        return lax.switch(k, [lambda v: v @ w, lambda v: v, lambda v: (v @ w) @ w], a)

    g = cpu(f, cast_outputs=False)
    for k in (0, 1, 2):
        got = variant(g)(X, W, jnp.int32(k))
        assert got.dtype == F32
        assert rel_err(got, f(X, W, k)) < 3e-2
    assert len(jaxpr_eqns(jax.make_jaxpr(g)(X, W, 1), "cond")) == 2
    assert set(dot_types(g, X, W, jnp.int32(1))) == {("bfloat16",) * 3}


def test_checkpoint_keeps_policy(variant):
    policy = jax.checkpoint_policies.dots_with_no_batch_dims_saveable

    def f(x, w):
        return jax.checkpoint(lambda v: jnp.sin(v @ w) @ w, policy=policy)(x).sum()

    g = cpu(f)
    remats = jaxpr_eqns(jax.make_jaxpr(g)(X, W), "checkpoint") or \
        jaxpr_eqns(jax.make_jaxpr(g)(X, W), "remat2")
    assert len(remats) == 1 and remats[0].params["policy"] is policy
    assert variant(jax.grad(g, argnums=1))(X, W).dtype == F32
    grad_dots = dot_types(jax.grad(g, argnums=1), X, W)
    assert grad_dots and all(t == ("bfloat16",) * 3 for t in grad_dots)
    assert rel_err(jax.grad(g, argnums=1)(X, W), jax.grad(f, argnums=1)(X, W)) < 3e-2


def test_custom_jvp_rule_still_used(variant):
    @jax.custom_jvp
    def clip_grad_sin(x):
        return jnp.sin(x)

    @clip_grad_sin.defjvp
    def _jvp(primals, tangents):
        (x,), (t,) = primals, tangents
        # A visible rule: the derivative is clipped to [-0.1, 0.1] (sin's is cos).
        return jnp.sin(x), jnp.clip(jnp.cos(x), -0.1, 0.1) * t

    def f(x, w):
        return clip_grad_sin(x @ w).sum()

    g = cpu(f)
    assert len(jaxpr_eqns(jax.make_jaxpr(g)(X, W), "custom_jvp_call")) == 1
    got = variant(jax.grad(g))(X, W)
    want = jax.grad(f)(X, W)
    assert got.dtype == F32
    np.testing.assert_allclose(got, want, rtol=3e-2, atol=3e-2)
    assert np.all(np.abs(np.asarray(got)) <= 0.1 * np.abs(np.asarray(W)).sum(1).max() + 1e-2)
    # The matmul inside still lowers, forward and backward.
    assert set(dot_types(jax.grad(g), X, W)) == {("bfloat16",) * 3}


def test_custom_jvp_follows_its_input_dtype(variant):
    # jax.nn.relu is a custom_jvp (around a jit): it runs in bfloat16 on a bfloat16 input, as
    # torch's relu does, and its jvp rule (also transformed) gives the gradient.
    f = lambda x, w: jax.nn.relu(x @ w) @ w
    g = cpu(f, cast_outputs=False)
    jaxpr = jax.make_jaxpr(g)(X, W)
    (call,) = jaxpr_eqns(jaxpr, "custom_jvp_call")
    assert eqn_dtypes(call) == (["bfloat16"], ["bfloat16"])
    assert variant(g)(X, W).dtype == BF16
    loss = lambda f: (lambda x, w: jnp.sum(f(x, w)))
    got = variant(jax.grad(loss(g), argnums=1))(X, W)
    assert got.dtype == F32 and rel_err(got, jax.grad(loss(f), argnums=1)(X, W)) < 3e-2


def test_custom_jvp_softmax():
    # Newer jax makes jax.nn.softmax a custom_jvp (this flag); both forms follow the table:
    # float32 on the cuda table's list, float32 inside the cpu table's kernel, which rounds its
    # result once to bfloat16 (torch's CPU softmax).
    previous = jax.config.jax_softmax_custom_jvp
    jax.config.update("jax_softmax_custom_jvp", True)
    try:
        f = lambda x, w: jax.nn.softmax(x @ w)
        for device_type, out_dtype in (("cuda", F32), ("cpu", BF16)):
            g = jamp.autocast(f, device_type=device_type, cast_outputs=False)
            assert len(jaxpr_eqns(jax.make_jaxpr(g)(X, W), "custom_jvp_call")) == 1
            exps = jaxpr_eqns(jax.make_jaxpr(g)(X, W), "exp")
            assert [eqn_dtypes(e)[1] for e in exps] == [["float32"]]
            assert jax.eval_shape(g, X, W).dtype == out_dtype
            loss = lambda f: (lambda x, w: jnp.sum(f(x, w)[:, 0]))
            got = jax.jit(jax.grad(loss(g), argnums=1))(X, W)
            assert rel_err(got, jax.grad(loss(f), argnums=1)(X, W)) < 3e-2
    finally:
        jax.config.update("jax_softmax_custom_jvp", previous)


def test_custom_vjp_bwd_still_used(variant):
    @jax.custom_vjp
    def scaled_matmul(x, w):
        return x @ w

    def fwd(x, w):
        return x @ w, (x, w)

    def bwd(res, g):
        x, w = res
        # A visible rule: the gradient of x is scaled by 10.
        return 10.0 * (g @ w.T), x.T @ g

    scaled_matmul.defvjp(fwd, bwd)
    f = lambda x, w: jnp.sum(jnp.tanh(scaled_matmul(x, w)))
    g = cpu(f)
    assert len(jaxpr_eqns(jax.make_jaxpr(g)(X, W), "custom_vjp_call")) == 1
    got_x, got_w = variant(jax.grad(g, argnums=(0, 1)))(X, W)
    want_x, want_w = jax.grad(f, argnums=(0, 1))(X, W)
    assert got_x.dtype == got_w.dtype == F32
    assert rel_err(got_x, want_x) < 3e-2 and rel_err(got_w, want_w) < 3e-2
    plain_x = jax.grad(lambda x, w: jnp.sum(jnp.tanh(x @ w)))(X, W)
    np.testing.assert_allclose(want_x, 10.0 * plain_x, rtol=1e-5)
    # The forward's matmul lowers; the user's bwd runs as written (autocast off, float32).
    dots = dot_types(jax.grad(g), X, W)
    assert ("bfloat16",) * 3 in dots and ("float32",) * 3 in dots


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((8,), ("d",))


def sharded_tanh_sum(mesh):
    """f(x, w): tanh(x @ w) summed over a batch split across the mesh; x sharded, w replicated."""
    x = jax.device_put(jnp.tile(X, (8, 1)), NamedSharding(mesh, P("d")))
    w = jax.device_put(W, NamedSharding(mesh, P()))

    def f(x, w):
        body = jax.shard_map(lambda a, b: lax.psum(jnp.tanh(a @ b).sum(0), "d"), mesh=mesh,
                             in_specs=(P("d"), P()), out_specs=P())
        return body(x, w)

    return f, x, w


def test_shard_map(mesh, variant):
    f, x, w = sharded_tanh_sum(mesh)
    out = variant(cpu(f, cast_outputs=False))(x, w)
    assert out.dtype == BF16
    assert rel_err(out, f(x, w)) < 3e-2


def test_shard_map_is_kept_and_differentiated(mesh):
    f, x, w = sharded_tanh_sum(mesh)
    g = cpu(f, cast_outputs=False)
    assert len(jaxpr_eqns(jax.make_jaxpr(g)(x, w), "shard_map")) == 1
    assert dot_types(g, x, w) == [("bfloat16",) * 3]
    grads = jax.jit(jax.grad(lambda x, w: cpu(f)(x, w).sum(), argnums=1))(x, w)
    assert grads.dtype == F32
    want = jax.jit(jax.grad(lambda x, w: f(x, w).sum(), argnums=1))(x, w)
    assert rel_err(grads, want) < 3e-2


@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
def test_data_parallel_shard_map_of_grad_of_autocast(mesh, device_type):
    # The ordinary data-parallel step: replicated weights, batch split over 8 devices, the
    # autocast loss differentiated inside shard_map. The replicated w meets the varying x.
    x = jax.device_put(jnp.tile(X, (8, 1)), NamedSharding(mesh, P("d")))
    w = jax.device_put(W, NamedSharding(mesh, P()))
    loss = lambda w, x: jnp.mean(jnp.tanh(x @ w) ** 2)

    def step(loss):
        grad = lambda w, x: lax.pmean(jax.grad(loss)(w, x), "d")
        return jax.jit(jax.shard_map(grad, mesh=mesh, in_specs=(P(), P("d")), out_specs=P()))

    auto = jamp.autocast(loss, device_type=device_type)
    got = step(auto)(w, x)
    assert got.dtype == F32 and rel_err(got, step(loss)(w, x)) < 3e-2
    dots = dot_types(step(auto), w, x)
    low = "bfloat16" if device_type == "cpu" else "float16"
    assert dots and all(t == (low,) * 3 for t in dots)


def test_vmap_outside(variant):
    xs = jnp.stack([X, 2 * X])
    f = lambda x, w: jnp.tanh(x @ w)
    g = jax.vmap(cpu(f, cast_outputs=False), in_axes=(0, None))
    out = variant(g)(xs, W)
    chex.assert_type(out, BF16)
    chex.assert_shape(out, (2, 3, 4))
    assert rel_err(out, jax.vmap(f, in_axes=(0, None))(xs, W)) < 3e-2
    assert set(dot_types(g, xs, W)) == {("bfloat16",) * 3}


def test_vmap_inside(variant):
    xs = jnp.stack([X, 2 * X])
    f = lambda xs, w: jax.vmap(lambda x: jnp.exp(x @ w))(xs)
    g = jamp.autocast(f, device_type="cuda", cast_outputs=False)
    assert variant(g)(xs, W).dtype == F32
    assert set(dot_types(g, xs, W)) == {("float16",) * 3}
    assert rel_err(g(xs, W), f(xs, W)) < 3e-2


def mlp_loss(params, x):
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    logits = h @ params["w2"]
    return -jnp.mean(jax.nn.log_softmax(logits)[:, 0])


@pytest.fixture(scope="module")
def mlp():
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    params = {"w1": jax.random.normal(k1, (8, 16)) / 3, "b1": jnp.zeros(16),
              "w2": jax.random.normal(k2, (16, 5)) / 4}
    return params, jax.random.normal(k3, (6, 8))


@pytest.mark.parametrize("device_type,dtype", [("cpu", jnp.bfloat16), ("cuda", jnp.float16)])
def test_grads_close_to_fp32_in_params_dtype(mlp, device_type, dtype, variant):
    params, x = mlp
    loss = jamp.autocast(mlp_loss, device_type=device_type, dtype=dtype)
    value, grads = variant(jax.value_and_grad(loss))(params, x)
    want_value, want = jax.value_and_grad(mlp_loss)(params, x)
    assert value.dtype == F32
    assert abs(float(value) - float(want_value)) / abs(float(want_value)) < 3e-2
    for k in params:
        assert grads[k].dtype == F32
        assert rel_err(grads[k], want[k]) < 3e-2, k
    # Every matmul of the backward runs in the forward's low dtype.
    name = np.dtype(dtype).name
    dots = dot_types(jax.grad(loss), params, x)
    assert len(dots) == 5 and all(low_matmul(t, name) for t in dots)


def test_grads_in_params_dtype_for_mixed_params(mlp):
    params, x = mlp
    params = dict(params, w2=params["w2"].astype(jnp.bfloat16))
    grads = jax.grad(cpu(mlp_loss))(params, x)
    assert {k: g.dtype for k, g in grads.items()} == {"w1": F32, "b1": F32, "w2": BF16}


def test_grad_inside_the_transformed_function(mlp):
    params, x = mlp

    def step(params, x):
        grads = jax.grad(mlp_loss)(params, x)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)

    g = cpu(step)
    new = jax.jit(g)(params, x)
    want = step(params, x)
    for k in params:
        assert new[k].dtype == F32 and rel_err(new[k], want[k]) < 1e-2
    assert all(low_matmul(t, "bfloat16") for t in dot_types(g, params, x))


def test_autocast_of_autocast_is_stable(mlp):
    params, x = mlp
    once = cpu(mlp_loss)
    twice = cpu(once)
    np.testing.assert_allclose(twice(params, x), once(params, x), rtol=1e-6)
