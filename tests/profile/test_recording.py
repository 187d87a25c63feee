"""What a profile records, used as users do and misuse it: work the block does not wait for,
compiles and collected programs inside the block, control flow and sharding; labels in loops,
odd names and eager transformations; the module paths of Flax's scanned and rematerialized
modules."""

import gc

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

from jamp.profile import emit_nvtx, profile, record_function

M, K, N = 8, 16, 32


def matmul_tanh(w, x):
    return jnp.tanh(x @ w)


W = jnp.full((K, N), 0.01, jnp.float32)
X = jnp.ones((M, K), jnp.float32)


def rows(prof):
    return {row.key: row for row in prof.key_averages()}


# --- What the profile sees -------------------------------------------------------------------

def test_work_the_block_did_not_wait_for_is_in_the_profile_and_earlier_work_is_not():
    f = jax.jit(lambda a: (a @ a) @ a)
    big = jnp.ones((256, 256))
    f(big).block_until_ready()
    for _ in range(3):
        f(big)  # dispatched before the profile, results dropped: not the block's work
    with profile() as prof:
        for _ in range(4):
            f(big)  # results dropped, never blocked on
    assert rows(prof)["jit__lambda"].count == 4
    # The profiler's own waiting leaves no rows.
    assert not [e for e in prof.events() if "barrier" in e.key]


def test_profile_inside_a_context_mesh():
    mesh = jax.make_mesh((len(jax.devices()),), ("data",))
    step = jax.jit(matmul_tanh)
    step(W, X).block_until_ready()
    with jax.set_mesh(mesh):
        with profile() as prof:
            step(W, X).block_until_ready()
    assert rows(prof)["jit_matmul_tanh"].count >= 1


def test_compiles_inside_the_block():
    with profile(with_flops=True, record_shapes=True) as prof:
        f = jax.jit(lambda a, b: a @ b)
        f(X, W).block_until_ready()  # compiled in the block
        f(W.T, X.T).block_until_ready()  # new shapes: a second program
    matmuls = sorted((e.input_shapes, e.flops) for e in prof.events() if e.flops)
    assert matmuls == [([[M, K], [K, N]], 2 * M * K * N), ([[N, K], [K, M]], 2 * N * K * M)]


def test_a_program_collected_before_the_profile_ends_is_rows_without_its_details():
    g = jax.jit(lambda a: a @ a.T + 1.0)
    g(X).block_until_ready()
    with profile(with_flops=True, record_shapes=True, profile_memory=True,
                 with_modules=True) as prof:
        g(X).block_until_ready()
        del g
        jax.clear_caches()
        gc.collect()  # its executable is gone before the profile reads the programs
    ops = [e for e in prof.events() if e.kind == "op" and e.key.startswith("jit__lambda::")]
    assert ops and not any(e.flops or e.input_shapes for e in ops)
    assert rows(prof)["jit__lambda"].count == 1


def test_counts_flops_and_self_times_through_control_flow_and_transformations():
    def f(w, x):
        c, _ = lax.scan(lambda c, _: (jnp.tanh(c @ w[:, :K]), None), x, None, length=3)
        _, c = lax.while_loop(lambda s: s[0] < 2, lambda s: (s[0] + 1, s[1] @ w[:, :K]), (0, c))
        c = lax.cond(c.sum() > 0, lambda a: a @ w[:, :K], lambda a: a, c)
        g = jax.grad(lambda w: (x @ w).sum())(w)  # d/dw only: one matmul
        v = jax.vmap(lambda r: r @ w)(x)
        return c.sum() + g.sum() + v.sum()

    step = jax.jit(f)
    step(W, X).block_until_ready()
    with profile(with_flops=True) as prof:
        for _ in range(2):
            step(W, X).block_until_ready()
    square, wide = 2 * M * K * K, 2 * M * K * N
    per_call = 3 * square + 2 * square + square + wide + wide
    assert sum(e.flops for e in prof.events()) == 2 * per_call
    assert rows(prof)["jit_f"].count == 2
    for event in prof.events():
        assert event.self_cpu_time_total >= 0, event
    assert [e.id for e in prof.events()] == list(range(len(prof.events())))


def test_sharded_jit_shard_map_and_pmap_count_every_devices_flops():
    devices = len(jax.devices())
    mesh = jax.make_mesh((devices,), ("d",))
    xs = jax.device_put(jnp.ones((devices * M, K)),
                        jax.sharding.NamedSharding(mesh, P("d")))
    mapped = jax.jit(jax.shard_map(lambda x, w: lax.psum(x @ w, "d"), mesh=mesh,
                                   in_specs=(P("d"), P()), out_specs=P()))
    pmapped = jax.pmap(lambda x, w: x @ w, in_axes=(0, None))
    stacked = jnp.ones((devices, M, K))
    mapped(xs, W).block_until_ready()
    pmapped(stacked, W).block_until_ready()
    with profile(with_flops=True) as prof:
        mapped(xs, W).block_until_ready()
        pmapped(stacked, W).block_until_ready()
    assert sum(e.flops for e in prof.events()) == 2 * (2 * devices * M * K * N)


# --- Labels ----------------------------------------------------------------------------------

def test_a_label_inside_a_loop_body_is_a_row():
    def f(w, x):
        def body(c, _):
            with record_function("in_body"):
                return jnp.tanh(c @ w), None
        return lax.scan(body, x, None, length=4)[0]

    step = jax.jit(f)
    square = jnp.full((K, K), 0.01)
    step(square, X).block_until_ready()
    with profile(with_flops=True) as prof:
        for _ in range(2):
            step(square, X).block_until_ready()
    assert rows(prof)["in_body"].count == 2  # one per program run
    label = [e for e in prof.events() if e.key == "in_body"][0]
    assert sum(m.flops for m in label.members) == 4 * 2 * M * K * K
    # It is inside its run, not a top-level event.
    assert label.parent.kind == "program"
    top = prof.key_averages().table(top_level_events_only=True)
    assert "in_body" not in top and "top-level" in top


@pytest.mark.parametrize("name", ["a/b", "step(0)", "jvp", "x->y"])
def test_labels_with_slashes_and_parentheses_inside_jit(name):
    @jax.jit
    def f(w, x):
        with record_function(name):
            return jnp.tanh(x @ w)

    f(W, X).block_until_ready()
    with profile(with_modules=True) as prof:
        f(W, X).block_until_ready()
    assert rows(prof)[name].count == 1


def test_nested_labels_and_decorators_on_host_and_jitted_functions():
    @record_function("host_fn")
    def host(x):
        return (x @ W).block_until_ready()

    @jax.jit
    @record_function("traced_fn")
    def traced(x):
        with record_function("same"):
            with record_function("same"):
                return jnp.tanh(x @ W)

    host(X)
    traced(X).block_until_ready()
    with profile() as prof:
        with record_function("outer"):
            with record_function("outer"):
                host(X)
            traced(X).block_until_ready()
    keys = rows(prof)
    assert keys["outer"].count == 2 and keys["host_fn"].count == 1
    assert keys["traced_fn"].count == 1 and keys["same"].count == 1
    for event in prof.events():
        assert event.self_cpu_time_total >= 0, event


def test_record_function_args_keep_torchs_key():
    with profile() as prof:
        with record_function("load", args="batch=3"):
            jnp.ones(3).block_until_ready()
    assert rows(prof)["load"].count == 1
    with pytest.raises(TypeError, match="args="):
        record_function("load", args=3)
    for bad in (None, 3, ""):
        with pytest.raises(TypeError, match="name="):
            record_function(bad)


def test_a_label_under_an_eager_grad_times_the_work_it_dispatches():
    def loss(w):
        with record_function("eager_grad"):
            return jnp.sin(w).sum()

    jax.grad(loss)(jnp.ones(4))
    with profile() as prof:
        jax.grad(loss)(jnp.ones(4)).block_until_ready()
    label = [e for e in prof.events() if e.key == "eager_grad"]
    assert len(label) == 1 and label[0].kind == "range" and label[0].children


def test_emit_nvtx_sizes_with_non_array_and_keyword_arguments():
    class Odd:
        shape = "not a shape"

    @emit_nvtx(record_shapes=True)
    def scaled(a, n, odd, *, scale=1.0):
        return a * n * scale

    with profile() as prof:
        scaled(jnp.ones((2, 3)), 3, Odd(), scale=jnp.ones(3)).block_until_ready()
        jax.jit(scaled, static_argnums=(1, 2))(jnp.ones(4), 2, None).block_until_ready()
    name = scaled.__qualname__
    assert {f"{name}, sizes = [[2, 3], [], []]", f"{name}, sizes = [[4], [], []]"} <= set(
        rows(prof))
    with pytest.raises(TypeError, match="name="):
        emit_nvtx(name=3)


# --- Module paths ----------------------------------------------------------------------------

def test_module_paths_of_scanned_and_rematerialized_flax_modules_hold_only_modules():
    class Layer(nn.Module):
        @nn.compact
        def __call__(self, c, _):
            return jax.nn.relu(nn.Dense(K, name="fc")(c)), None

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            layers = nn.scan(Layer, variable_axes={"params": 0},
                             split_rngs={"params": True}, length=3)
            x, _ = layers(name="layers")(x, None)
            x = nn.remat(nn.Dense)(K, name="remat_fc")(x)
            return nn.Dense(N, name="head")(x)

    model = Model()
    params = model.init(jax.random.PRNGKey(0), X)
    apply = jax.jit(model.apply)
    apply(params, X).block_until_ready()
    with profile(with_modules=True, with_flops=True) as prof:
        apply(params, X).block_until_ready()
    paths = {e.module_hierarchy for e in prof.events() if e.flops}
    assert paths == {"Model/layers/fc", "Model/remat_fc", "Model/head"}, paths
    assert sum(e.flops for e in prof.events()) == 4 * 2 * M * K * K + 2 * M * K * N
