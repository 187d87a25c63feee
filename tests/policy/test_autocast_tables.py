"""The op tables: their primitives are the ones jnp / jax.nn emit, they agree with torch's CPU
autocast where torch can be run here, and they can be extended and overridden."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import Primitive

import jamp
from jamp.policy import autocast_tables
from jamp.policy.autocast_tables import (
    ACCEPTED_DEVICE_TYPES, DEFAULT_TABLES, DEVICE_ALIASES, FP32, LOWER, OpTable, autocast_table,
    canonical_device_type)

from helpers import BF16, F16, F32, jaxpr_equations

# Positive, so that log, rsqrt and x ** x are defined.
X = jnp.linspace(0.1, 1.0, 12, dtype=jnp.float32).reshape(3, 4)

# What user-level functions trace to: each table entry must name a primitive JAX emits.
EMITTED = {
    "dot_general": lambda x: x @ x.T,
    "conv_general_dilated": lambda x: jax.lax.conv_general_dilated(
        x[None, None], x[None, None, :2, :2], (1, 1), "SAME"),
    "exp": jnp.exp, "exp2": jnp.exp2, "expm1": jnp.expm1, "log": jnp.log,
    "log1p": jnp.log1p, "pow": lambda x: x ** x, "integer_pow": lambda x: x ** 3,
    "rsqrt": jax.lax.rsqrt,
    "acos": lambda x: jnp.arccos(x / 2), "asin": lambda x: jnp.arcsin(x / 2), "cosh": jnp.cosh,
    "sinh": jnp.sinh, "tan": jnp.tan, "erf_inv": lambda x: jax.scipy.special.erfinv(x / 2),
    "reduce_sum": jnp.sum, "reduce_prod": jnp.prod, "cumsum": lambda x: jnp.cumsum(x, 0),
    "cumprod": lambda x: jnp.cumprod(x, 0),
    "cumlogsumexp": lambda x: jax.lax.cumlogsumexp(x, 0),
    "cholesky": lambda x: jnp.linalg.cholesky(x @ x.T + jnp.eye(3)),
    "triangular_solve": lambda x: jax.scipy.linalg.solve_triangular(
        jnp.eye(3) + jnp.tril(x @ x.T), x),
    "lu": lambda x: jnp.linalg.solve(x @ x.T + jnp.eye(3), x),
    "qr": lambda x: jnp.linalg.qr(x)[0], "svd": lambda x: jnp.linalg.svd(x)[1],
    "eigh": lambda x: jnp.linalg.eigh(x @ x.T)[0],
    "ormqr": lambda x: jax.lax.linalg.ormqr(x.T, x[:, 0], x.T),
    "tridiagonal": lambda x: jax.lax.linalg.tridiagonal(x[:, :3] @ x[:, :3].T)[0],
    "cholesky_update": lambda x: jax.lax.linalg.cholesky_update(jnp.eye(3), x[:, 0]),
    "fft": lambda x: jnp.fft.rfft(x).real,
}


def primitives_of(f, *args):
    return {eqn.primitive.name for eqn in jaxpr_equations(jax.make_jaxpr(f)(*args))}


@pytest.mark.parametrize("name", sorted(EMITTED))
def test_table_primitive_is_what_jax_emits(name):
    assert name in primitives_of(EMITTED[name], X)


def test_every_table_entry_is_checked_or_documented():
    # Entries not in EMITTED are primitives of less common functions, listed here on purpose.
    documented_only = {"log2", "ragged_dot_general", "householder_product", "geqrf", "eig", "schur",
                       "hessenberg", "tridiagonal_solve"}
    for table in DEFAULT_TABLES.values():
        assert set(table.rules) <= set(EMITTED) | documented_only


def test_composites_trace_to_listed_primitives():
    # torch lists softmax, log_softmax, layer_norm, mse_loss: here they are built from listed
    # primitives, so their float32 parts run in float32 on the CUDA table.
    cuda = autocast_table("cuda")
    for f in (jax.nn.softmax, jax.nn.log_softmax, jax.nn.logsumexp,
              lambda x: jnp.mean((x - 1.0) ** 2), lambda x: jnp.linalg.norm(x)):
        assert any(cuda.rule(p) == FP32 for p in primitives_of(f, X)), f


def test_default_tables():
    assert autocast_table("cuda").default_dtype == F16
    assert autocast_table("gpu") is autocast_table("cuda")
    assert autocast_table("cpu").default_dtype == BF16
    assert autocast_table("tpu").default_dtype == BF16
    for table in DEFAULT_TABLES.values():
        assert table.rule("dot_general") == LOWER
        assert table.rule("conv_general_dilated") == LOWER
        assert table.rule("add") is None
    assert autocast_table("cuda").rule("exp") == FP32
    assert autocast_table("cpu").rule("exp") is None
    assert autocast_table("cpu").rule("reduce_prod") == FP32


TABLE_NAMES = ("ACCUMULATE_FP32", "DEFAULT_TABLES", "FP32", "LOWER", "OpTable", "autocast_table")


@pytest.mark.parametrize("name", TABLE_NAMES)
def test_op_tables_are_public_in_jamp_policy_only(name):
    assert name in jamp.policy.__all__
    assert getattr(jamp.policy, name) is getattr(autocast_tables, name)
    assert name not in jamp.transforms.__all__
    assert not hasattr(jamp.transforms, name)


def test_a_table_from_jamp_policy_drives_autocast():
    table = jamp.policy.autocast_table("cpu").updated({"dot_general": "float16"})
    x = np.ones((2, 2), np.float32)
    out = jamp.autocast(lambda a: a @ a, op_table=table, cast_outputs=False)(x)
    assert out.dtype == np.float16


def test_tables_are_read_only_and_updates_are_copies():
    table = autocast_table("cpu")
    with pytest.raises(TypeError):
        table.rules["exp"] = FP32
    updated = table.updated({"exp": FP32, "dot_general": jnp.float16})
    assert updated.rule("exp") == FP32 and updated.rule("dot_general") == F16
    assert table.rule("exp") is None and table.rule("dot_general") == LOWER
    assert updated.without("exp").rule("exp") is None
    assert updated == table.updated({"dot_general": "float16", "exp": FP32})
    assert hash(updated) == hash(table.updated({"dot_general": "f16", "exp": FP32}))


def test_custom_table_from_scratch():
    table = OpTable("cpu", "float16", {"dot_general": LOWER})
    f = jamp.autocast(lambda x: (x @ x.T, jnp.prod(x)), op_table=table, cast_outputs=False)
    assert [o.dtype for o in f(X)] == [F16, F32]


@pytest.mark.parametrize("spelling,canonical", [
    ("cuda", "cuda"), ("GPU", "cuda"), ("cpu", "cpu"), ("tpu", "tpu")])
def test_device_spellings(spelling, canonical):
    assert canonical_device_type(spelling) == canonical
    assert set(ACCEPTED_DEVICE_TYPES) >= {"cuda", "gpu", "cpu", "tpu"}


def test_the_accepted_device_types_are_the_tables_and_their_aliases():
    assert set(ACCEPTED_DEVICE_TYPES) == set(DEFAULT_TABLES) | set(DEVICE_ALIASES)
    assert len(ACCEPTED_DEVICE_TYPES) == len(set(ACCEPTED_DEVICE_TYPES))
    assert {"rocm", "gpu"} <= set(ACCEPTED_DEVICE_TYPES)


@pytest.mark.parametrize("spelling", ACCEPTED_DEVICE_TYPES)
def test_every_accepted_device_type_selects_a_table(spelling):
    for written in (spelling, spelling.upper(), f" {spelling} "):
        table = autocast_table(written)
        assert table is DEFAULT_TABLES[canonical_device_type(written)]


@pytest.mark.parametrize("alias", ["rocm", "ROCm", "gpu"])
def test_gpu_aliases_select_the_cuda_table(alias):
    assert canonical_device_type(alias) == "cuda"
    region = jamp.autocast(device_type=alias)
    assert region.device_type == "cuda"
    assert region.table is DEFAULT_TABLES["cuda"]


@pytest.mark.parametrize("bad", ["xpu", "Cuda:0", " metal ", ""])
def test_an_unknown_device_type_is_named_as_written_beside_every_accepted_one(bad):
    with pytest.raises(ValueError) as info:
        canonical_device_type(bad)
    message = str(info.value)
    assert repr(bad) in message
    for accepted in ACCEPTED_DEVICE_TYPES:
        assert repr(accepted) in message
    with pytest.raises(ValueError, match=re.escape(repr(bad))):
        jamp.autocast(device_type=bad)


@pytest.mark.parametrize("bad", [3, None, jax.devices()[0]])
def test_a_device_type_that_is_not_a_string_is_a_type_error(bad):
    with pytest.raises(TypeError, match="device_type") as info:
        canonical_device_type(bad)
    assert "'rocm'" in str(info.value)


# torch's CPU autocast, run here as an oracle (bfloat16).
TORCH_CASES = {
    "mm": (lambda t, a: a @ a.T, lambda x: x @ x.T),
    "exp": (lambda t, a: t.exp(a @ a.T), lambda x: jnp.exp(x @ x.T)),
    "sum": (lambda t, a: (a @ a.T).sum(-1), lambda x: jnp.sum(x @ x.T, -1)),
    "cross_entropy": (lambda t, a: t.nn.functional.cross_entropy(a @ a.T, t.tensor([0, 1, 2])),
                      lambda x: -jnp.mean(jax.nn.log_softmax(x @ x.T)[jnp.arange(3),
                                                                       jnp.arange(3)])),
    "prod": (lambda t, a: t.prod(a @ a.T), lambda x: jnp.prod(x @ x.T)),
    "cumprod": (lambda t, a: t.cumprod(a @ a.T, 0), lambda x: jnp.cumprod(x @ x.T, 0)),
    "add_f32": (lambda t, a: (a @ a.T) + a[:, :3], lambda x: (x @ x.T) + x[:, :3]),
    "mul_scalar": (lambda t, a: (a @ a.T) * 2.0, lambda x: (x @ x.T) * 2.0),
    "softmax": (lambda t, a: t.softmax(a @ a.T, -1), lambda x: jax.nn.softmax(x @ x.T)),
    "log_softmax": (lambda t, a: t.log_softmax(a @ a.T, -1),
                    lambda x: jax.nn.log_softmax(x @ x.T)),
    "tanh": (lambda t, a: t.tanh(a @ a.T), lambda x: jnp.tanh(x @ x.T)),
    "qr": (lambda t, a: t.linalg.qr(a @ a.T)[0], lambda x: jnp.linalg.qr(x @ x.T)[0]),
    "exp_f32": (lambda t, a: t.exp(a), jnp.exp),
}


@pytest.mark.parametrize("case", sorted(TORCH_CASES))
def test_cpu_table_matches_torch_cpu_autocast(torch, case):
    torch_fn, jax_fn = TORCH_CASES[case]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = torch_fn(torch, torch.from_numpy(np.array(X)))
    got = jamp.autocast(jax_fn, device_type="cpu", cast_outputs=False)(X)
    assert got.dtype.name == str(want.dtype).removeprefix("torch.")


@pytest.mark.parametrize("name,says", [
    ("softmax", "it traces to reduce_max, max, sub, exp, reduce_sum, div"),
    ("layer_norm", "rsqrt"),
    ("dot_generl", "did you mean 'dot_general'"),
])
def test_names_that_are_not_primitives_are_refused(name, says):
    with pytest.raises(ValueError) as raised:
        autocast_table("cuda").updated({name: FP32})
    message = str(raised.value)
    assert repr(name) in message and says in message
    assert "jamp.transforms.primitive_names" in message


MY_FUSED_OP = Primitive("my_fused_op")


def test_a_primitive_of_your_own_is_accepted():
    table = autocast_table("cpu").updated({MY_FUSED_OP: FP32})
    assert table.rule("my_fused_op") == FP32
    # By name too: it is defined at the top level of a loaded module.
    assert autocast_table("cpu").updated({"my_fused_op": LOWER}).rule("my_fused_op") == LOWER


def test_primitive_names_lists_what_a_function_traces_to():
    names = jamp.transforms.primitive_names(jax.nn.softmax, X)
    assert {"exp", "reduce_max", "reduce_sum", "div"} <= set(names)
    assert names == list(dict.fromkeys(names))  # each once


def test_primitive_classes_name_only_primitives():
    from jamp import _jax_internals
    from jamp.policy import primitives

    for group in (primitives.MOVES, primitives.ELEMENTWISE, primitives.SELECTIONS,
                  primitives.REDUCTIONS, primitives.COLLECTIVES, primitives.CUMULATIVE,
                  _jax_internals.CALLS):
        assert primitives.unknown_names(sorted(group)) == []


def test_log2_computes_in_float32_on_the_cuda_table_in_every_jax():
    # jax 0.12 traces jnp.log2 to its own primitive, earlier versions to log and div: torch's
    # CUDA list holds log2, and either way the logarithm runs in float32.
    f = jamp.autocast(jnp.log2, device_type="cuda", dtype=F16, cast_outputs=False)
    x = X.astype(F16)
    logs = [e for e in jaxpr_equations(jax.make_jaxpr(f)(x))
            if e.primitive.name in ("log", "log2")]
    assert logs and all(v.aval.dtype == F32 for e in logs for v in e.invars)


def test_cpu_table_sums_to_one_number_in_float32():
    # torch's CPU float32 list holds the losses, which sum a batch to one number; in a jaxpr
    # that sum is the float32 op. A bare `.sum()` of bfloat16 values, which torch returns in
    # bfloat16, is the documented price (docs/autocast.md).
    loss = jamp.autocast(lambda x: jnp.sum(jnp.log(jnp.abs(x @ x.T) + 1.0)), device_type="cpu",
                         cast_outputs=False)
    jaxpr = jax.make_jaxpr(loss)(X)
    computed = {e.primitive.name: [v.aval.dtype for v in e.invars] for e in jaxpr.eqns}
    assert loss(X).dtype == F32
    assert computed["log"] == [F32] and computed["reduce_sum"] == [F32]
    assert all(d == BF16 for d in computed["dot_general"])
    kept_axis = jamp.autocast(lambda x: jnp.sum(x @ x.T, -1), device_type="cpu",
                              cast_outputs=False)
    assert kept_axis(X).dtype == BF16
    assert autocast_table("cpu").scalar_results == FP32
    assert autocast_table("cuda").scalar_results is None


def test_scalar_results_is_part_of_the_table():
    cpu = autocast_table("cpu")
    assert cpu.updated({"exp": FP32}).scalar_results == FP32  # kept by updated and without
    assert cpu.without("exp").scalar_results == FP32
    plain = OpTable("cpu", "bfloat16", dict(cpu.rules))
    assert plain != cpu and hash(plain) != hash(cpu)
    assert plain.rule("reduce_sum", scalar_result=True) == cpu.rule("reduce_sum")
    assert cpu.rule("reduce_sum", scalar_result=True) == FP32
    with pytest.raises(ValueError, match="scalar_results"):
        OpTable("cpu", "bfloat16", {}, scalar_results="fastest")
    off = dataclasses.replace(cpu, scalar_results=None)  # the documented way to turn it off
    loss = jamp.autocast(lambda x: jnp.sum(jnp.exp(x @ x.T)), op_table=off, cast_outputs=False)
    assert loss(X).dtype == BF16
