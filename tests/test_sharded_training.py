"""Sharded params and optimizer state through autocast, `loss_scaled` and `jamp.initialize`, on
the tests' 8 CPU devices: FSDP over a "data" axis and tensor parallelism over a 2-D "data" x
"model" mesh, with Auto axes (`jax.jit` places the collectives), Explicit axes (shardings in
the types, `jax.set_mesh`, `jax.sharding.reshard`) and `shard_map`.

Every leaf keeps its sharding through a training step (read from `.sharding` or the type: no
silent gather to one device), a sharding constraint inside the model survives autocast, one
non-finite shard makes every shard skip, and the half-precision cast runs per shard, before the
all-gathers, so an FSDP step at O1 or O2 gathers half the bytes of a float32 one.
"""

import re

import flax.linen as nn
import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P, reshard

import jamp
from jamp.profile import hlo

from helpers import hlo_op_types, jaxpr_eqns

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices")

_ALL_GATHER = re.compile(r"= (\w+)\[([\d,]*)\]\S* all-gather(?:-start)?\(")


def all_gathers(compiled_text: str) -> list[tuple[str, int]]:
    """The element type and the element count of each all-gather's result in a compiled
    (partitioned) program."""
    return [(m.group(1), int(np.prod([int(d) for d in m.group(2).split(",") if d])))
            for m in _ALL_GATHER.finditer(compiled_text)]


def mesh_of(shape, names, axis_type=AxisType.Auto):
    return jax.make_mesh(shape, names, axis_types=(axis_type,) * len(shape))


def train_step(apply_fn, tx):
    def step(params, opt_state, x):
        def loss(p):
            out = apply_fn({"params": p}, x).astype(jnp.float32)
            return jamp.scale_loss(jnp.mean(out ** 2), opt_state)

        updates, opt_state = tx.update(jax.grad(loss)(params), opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return step


def leaves_with_paths(tree):
    return [(jax.tree_util.keystr(p), x) for p, x in jax.tree_util.tree_leaves_with_path(tree)]


def assert_sharded_like(tree, reference):
    """Each array of `tree` has the sharding of the same-shaped leaf of `reference` (params,
    and their masters and moments), over all 8 devices. (Scalars, the counters and loss
    scales, are where jit puts them.)"""
    by_shape = {x.shape: x.sharding for _, x in leaves_with_paths(reference)}
    arrays = [(path, x) for path, x in leaves_with_paths(tree) if x.ndim]
    assert arrays
    for path, x in arrays:
        assert len(x.sharding.device_set) == 8, path
        want = by_shape[x.shape]
        assert x.sharding.is_equivalent_to(want, x.ndim), (path, x.sharding, want)


# --- FSDP over "data", Auto axes --------------------------------------------------------------


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(16)(nn.relu(nn.Dense(64)(x)))


def fsdp_put(tree, mesh):
    """Each leaf split over "data" along its first dimension that 8 divides."""
    def put(x):
        dims = [d for d, n in enumerate(x.shape) if n % 8 == 0]
        spec = [None] * x.ndim
        if dims:
            spec[dims[0]] = "data"
        return jax.device_put(x, NamedSharding(mesh, P(*spec)))
    return jax.tree_util.tree_map(put, tree)


@pytest.fixture(scope="module")
def fsdp():
    """Per opt level: the compiled FSDP step, its inputs and its outputs."""
    mesh = mesh_of((8,), ("data",))
    model = MLP()
    x = jax.device_put(jnp.linspace(-1, 1, 16 * 32).reshape(16, 32), NamedSharding(mesh, P("data")))
    variables = fsdp_put(model.init(jax.random.key(0), x), mesh)
    runs = {}
    for level in ("O0", "O1", "O2"):
        apply_fn, amp_variables, tx = jamp.initialize(model.apply, variables, optax.adam(1e-3),
                                                      opt_level=level, verbosity=0)
        params = amp_variables["params"]
        # With Auto axes, jit lets XLA place what no input decides: Adam's zero moments. The
        # optimizer state is sharded as the params, by the user, as for any optax state.
        opt_state = fsdp_put(jax.jit(tx.init)(params), mesh)
        step = jax.jit(train_step(apply_fn, tx))
        runs[level] = dict(apply_fn=apply_fn, tx=tx, params=params, opt_state=opt_state, x=x,
                           step=step,
                           compiled=step.lower(params, opt_state, x).compile().as_text(),
                           out=step(params, opt_state, x))
    return runs


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_fsdp_step_keeps_params_masters_and_moments_sharded(fsdp, level):
    run = fsdp[level]
    # initialize kept the shardings of the variables it was given.
    assert run["params"]["Dense_0"]["kernel"].sharding.spec == P("data", None)
    assert run["params"]["Dense_0"]["bias"].sharding.spec == P("data")
    new_params, new_state = run["out"]
    assert_sharded_like(new_params, run["params"])
    assert_sharded_like(new_state, run["params"])
    if level == "O2":
        masters = jamp.master_params(new_state)
        assert masters["Dense_0"]["kernel"].dtype == jnp.float32
        assert masters["Dense_0"]["kernel"].sharding.is_equivalent_to(
            run["params"]["Dense_0"]["kernel"].sharding, 2)
    assert int(new_state.skipped_steps) == 0


def test_the_half_cast_runs_per_shard_so_fsdp_gathers_half_the_bytes(fsdp):
    gathered = {level: all_gathers(run["compiled"]) for level, run in fsdp.items()}
    # float32 params gather float32; at O2 the half params are made from the float32 masters
    # shard by shard, and at O1 autocast's casts of the float32 params run on the shards too:
    # the same gathers, in float16.
    assert {t for t, _ in gathered["O0"]} == {"f32"}
    assert gathered["O1"] == gathered["O2"] == [("f16", n) for _, n in gathered["O0"]]
    assert sum(n for _, n in gathered["O0"]) >= 64 * 32 + 64 * 16  # the kernels, at least


def partitioned(lowered, directory) -> str:
    """The text of `lowered`'s program as XLA's SPMD partitioner leaves it (its collectives
    placed), before the backend's own passes: the CPU backend, which has no float8 kernels,
    widens every float8 op to float16 after partitioning, all-gathers included (a GPU
    backend moves float8 as it is)."""
    lowered.compile(compiler_options={"xla_dump_to": str(directory),
                                      "xla_dump_hlo_pass_re": "spmd-partitioning"})
    (path,) = directory.glob("*after_spmd-partitioning*")
    return path.read_text()


def gathered_bytes(gathers: list[tuple[str, int]]) -> int:
    """Bytes of (HLO element type, element count) all-gathers."""
    return sum(n * hlo.parse_types(f"{kind}[]")[0].nbytes for kind, n in gathers)


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_fp8_layers_cast_their_kernels_per_shard_and_gather_float8(fsdp, level, tmp_path):
    # The float8 casts run on the shards (the amax is an all-reduce) and the products take
    # the float8 kernels, so the FSDP step gathers them in one byte an element.
    run = fsdp[level]
    apply = jamp.autocast(run["apply_fn"], dtype=jnp.float16,
                          rules=[("Dense_*", jamp.fp8.recipe("tensorwise"))])
    step = jax.jit(train_step(apply, run["tx"]))
    gathered = all_gathers(partitioned(step.lower(run["params"], run["opt_state"], run["x"]),
                                       tmp_path))
    assert sorted(n for kind, n in gathered if kind == "f8e4m3fn") == [64 * 16, 32 * 64]
    assert not [kind for kind, _ in gathered if kind == "f32"]
    assert gathered_bytes(gathered) < gathered_bytes(all_gathers(run["compiled"])) * 0.6


def test_one_nonfinite_shard_makes_every_shard_skip(fsdp):
    run = fsdp["O2"]
    x = np.asarray(run["x"]).copy()
    x[13, 5] = np.inf  # a row that device 6 holds
    bad = jax.device_put(x, run["x"].sharding)
    params, state = run["step"](run["params"], run["opt_state"], bad)
    assert not bool(state.last_finite) and int(state.skipped_steps) == 1
    assert float(jamp.get_loss_scale(state).loss_scale) == 32768.0
    for new, old in zip(jax.tree_util.tree_leaves((params, jamp.master_params(state))),
                        jax.tree_util.tree_leaves((run["params"],
                                                   jamp.master_params(run["opt_state"])))):
        for a, b in zip(new.addressable_shards, old.addressable_shards):
            np.testing.assert_array_equal(np.asarray(a.data), np.asarray(b.data))


# --- tensor parallelism over "data" x "model", Auto axes --------------------------------------


class TensorParallelMLP(nn.Module):
    """Megatron's pair: a column-parallel Dense then a row-parallel one, the hidden activation
    constrained to (batch over "data", features over "model")."""

    mesh: jax.sharding.Mesh

    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.Dense(32)(x))
        h = jax.lax.with_sharding_constraint(h, NamedSharding(self.mesh, P("data", "model")))
        return nn.Dense(8)(h)


TP_SPECS = {"Dense_0": {"kernel": P(None, "model"), "bias": P("model")},
            "Dense_1": {"kernel": P("model", None), "bias": P()}}


@pytest.fixture(scope="module")
def tensor_parallel():
    mesh = mesh_of((4, 2), ("data", "model"))
    model = TensorParallelMLP(mesh)
    x = jax.device_put(jnp.linspace(-1, 1, 8 * 16).reshape(8, 16),
                       NamedSharding(mesh, P("data", None)))
    params = model.init(jax.random.key(1), x)["params"]
    params = jax.tree_util.tree_map(lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec)),
                                    params, TP_SPECS)
    return mesh, model, {"params": params}, x


def test_sharding_constraint_inside_the_model_survives_autocast(tensor_parallel):
    mesh, model, variables, x = tensor_parallel
    amp_apply = jamp.autocast(model.apply, dtype=jnp.float16)
    jaxpr = jax.make_jaxpr(amp_apply)(variables, x)
    constraints = jaxpr_eqns(jaxpr, "sharding_constraint")
    assert [eqn.params["sharding"].spec for eqn in constraints] == [P("data", "model")]
    # It constrains the float16 activation the matmul made.
    assert constraints[0].invars[0].aval.dtype == jnp.float16
    assert [t[:2] for t in hlo_op_types(jax.jit(amp_apply).lower(variables, x).as_text(),
                                        "dot_general")] == [("float16", "float16")] * 2
    out = jax.jit(amp_apply)(variables, x)
    np.testing.assert_allclose(np.asarray(out, np.float32),
                               np.asarray(model.apply(variables, x)), rtol=2e-2, atol=2e-3)


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_tensor_parallel_step_keeps_every_sharding(tensor_parallel, level):
    mesh, model, variables, x = tensor_parallel
    apply_fn, amp_variables, tx = jamp.initialize(model.apply, variables, optax.adam(1e-3),
                                                  opt_level=level, verbosity=0)
    params = amp_variables["params"]
    assert_sharded_like(params, variables["params"])
    opt_state = jax.jit(tx.init)(params)
    new_params, new_state = jax.jit(train_step(apply_fn, tx))(params, opt_state, x)
    assert_sharded_like(new_params, variables["params"])
    assert_sharded_like(new_state, variables["params"])
    out = jax.jit(apply_fn)(amp_variables, x)
    assert out.sharding.is_equivalent_to(NamedSharding(mesh, P("data", None)), 2)
    assert bool(new_state.last_finite)


# --- Explicit axes: shardings in the types ----------------------------------------------------


class ExplicitFSDP(nn.Module):
    """With Explicit axes the model says where each gather happens: each kernel, stored split
    over "data", is gathered whole (`reshard`) right where it is used."""

    @nn.compact
    def __call__(self, x):
        k1 = self.param("k1", nn.initializers.lecun_normal(), (32, 64))
        k2 = self.param("k2", nn.initializers.lecun_normal(), (64, 16))
        h = nn.relu(x @ reshard(k1, P()))
        return h @ reshard(k2, P())


@pytest.fixture(scope="module")
def explicit():
    """Per opt level, under an Explicit-axes mesh: what initialize returned, the optimizer
    state and the batch."""
    mesh = mesh_of((8,), ("data",), AxisType.Explicit)
    model = ExplicitFSDP()
    runs = {}
    with jax.set_mesh(mesh):
        x = jax.device_put(jnp.linspace(-1, 1, 16 * 32).reshape(16, 32), P("data", None))
        init = model.init(jax.random.key(2), x)["params"]
        init = {"k1": reshard(init["k1"], P("data", None)), "k2": reshard(init["k2"], P("data"))}
        for level in ("O0", "O2"):
            apply_fn, variables, tx = jamp.initialize(model.apply, {"params": init},
                                                      optax.adam(1e-3), opt_level=level,
                                                      verbosity=0)
            # Explicit axes carry the sharding in the type: Adam's zero moments inherit it.
            opt_state = jax.jit(tx.init)(variables["params"])
            runs[level] = dict(apply_fn=apply_fn, tx=tx, variables=variables,
                               opt_state=opt_state)
    return mesh, x, runs


def test_explicit_axes_keep_shardings_in_the_types(explicit, variant):
    mesh, x, runs = explicit
    run = runs["O2"]
    params = run["variables"]["params"]
    with jax.set_mesh(mesh):
        new_params, new_state = variant(train_step(run["apply_fn"], run["tx"]))(
            params, run["opt_state"], x)
        out = run["apply_fn"](run["variables"], x)
    for tree in (params, run["opt_state"], new_params, new_state):
        for path, leaf in leaves_with_paths(tree):
            if leaf.ndim:
                assert jax.typeof(leaf).sharding.spec in (P("data", None), P("data")), path
    assert jax.typeof(out).sharding.spec == P("data", None) and out.dtype == jnp.float32
    assert jamp.master_params(new_state)["k1"].dtype == jnp.float32
    assert bool(new_state.last_finite)


def test_explicit_axes_gather_the_half_shards(explicit):
    mesh, x, runs = explicit
    gathered = {}
    with jax.set_mesh(mesh):
        for level, run in runs.items():
            step = jax.jit(train_step(run["apply_fn"], run["tx"]))
            gathered[level] = all_gathers(step.lower(run["variables"]["params"],
                                                     run["opt_state"], x).compile().as_text())
    # The kernels' gathers (the reshards the model asks for) carry float32 at O0 and float16
    # at O2: the float16 shards are cast from the float32 masters before they are gathered.
    kernels = sorted(n for t, n in gathered["O0"] if t == "f32" and n in (32 * 64, 64 * 16))
    assert kernels == [64 * 16, 32 * 64]
    assert sorted(n for t, n in gathered["O2"] if n in kernels and t == "f16") == kernels
    assert not [n for t, n in gathered["O2"] if n in kernels and t == "f32"]


# --- shard_map ---------------------------------------------------------------------------------


def test_shard_map_fsdp_gathers_the_half_shards_and_decides_once(fsdp):
    """The FSDP forward and backward written with shard_map: each device gathers the params
    from their shards with `all_gather`. At O2 the shards it gathers are float16 (made from the
    float32 masters shard by shard), in the lowered program itself. The optimizer runs outside
    shard_map, under jit, where its finiteness check is global."""
    run = fsdp["O2"]
    params, opt_state, x, tx = run["params"], run["opt_state"], run["x"], run["tx"]
    specs = jax.tree_util.tree_map(lambda a: a.sharding.spec, params)

    def gather(a, spec):
        if "data" not in spec:
            return a
        return jax.lax.all_gather(a, "data", axis=list(spec).index("data"), tiled=True)

    def local_grads(params, x, scale):
        def loss(p):
            full = jax.tree_util.tree_map(gather, p, specs)
            out = run["apply_fn"]({"params": full}, x).astype(jnp.float32)
            return jax.lax.pmean(jnp.mean(out ** 2), "data") * scale
        return jax.grad(loss)(params)

    grads_of = jax.shard_map(local_grads, mesh=x.sharding.mesh,
                             in_specs=(specs, P("data"), P()), out_specs=specs)

    @jax.jit
    def step(params, opt_state, x):
        grads = grads_of(params, x, jamp.get_loss_scale(opt_state).loss_scale)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    gathers = hlo_op_types(step.lower(params, opt_state, x).as_text(), "all_gather")
    assert len(gathers) == 4 and all(types == ("float16", "float16") for types in gathers)
    new_params, new_state = step(params, opt_state, x)
    assert_sharded_like(new_params, params)
    assert_sharded_like(new_state, params)
    # The same step as the jit-placed one, up to the order of float16 sums.
    chex.assert_trees_all_close(jamp.master_params(new_state),
                                jamp.master_params(run["out"][1]), rtol=1e-7, atol=2e-3)
    bad = np.asarray(x).copy()
    bad[2, 0] = np.nan
    skipped_params, skipped = step(params, opt_state, jax.device_put(bad, x.sharding))
    assert int(skipped.skipped_steps) == 1
    chex.assert_trees_all_equal(skipped_params, params)
