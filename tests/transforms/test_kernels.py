"""Ops torch computes as one kernel, rebuilt from primitives: normalizations (float32 inside,
the activation's dtype out, on the cpu table), scatters, dot products, and recurrent loops whose
carries take the low dtype (see docs/autocast.md, "Deviations from torch")."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax import lax

import jamp
from jamp import _jax_internals as jx

from helpers import BF16, F16, F32, eqn_dtypes, jaxpr_equations, jaxpr_eqns, rel_err

KEY = jax.random.split(jax.random.key(0), 4)
ACT = jax.random.normal(KEY[0], (8, 64)) * 3.0 + 1.0
W64 = jax.random.normal(KEY[1], (64, 64)) / 8.0


def cpu(f, **kw):
    return jamp.autocast(f, device_type="cpu", cast_outputs=False, **kw)


def _below_float32(jaxpr, primitives):
    """The equations of `primitives` (sub-jaxprs included) with an input below float32."""
    return [e for e in jaxpr_equations(jaxpr.jaxpr) if e.primitive.name in primitives
            and any(d in ("bfloat16", "float16") for d in eqn_dtypes(e)[0])]


# -- normalizations --------------------------------------------------------------------------

NORMS = {
    "LayerNorm": lambda: nn.LayerNorm(),
    "RMSNorm": lambda: nn.RMSNorm(),
    "GroupNorm": lambda: nn.GroupNorm(num_groups=8),
    "BatchNorm": lambda: nn.BatchNorm(use_running_average=False),
    # Eval mode centres by the running mean outside the statistics' chain.
    "BatchNormEval": lambda: nn.BatchNorm(use_running_average=True),
}


class DenseThenNorm(nn.Module):
    norm: str

    @nn.compact
    def __call__(self, x):
        return NORMS[self.norm]()(nn.Dense(64, use_bias=False)(x))


@pytest.mark.parametrize("norm", sorted(NORMS))
def test_cpu_norm_computes_in_float32_and_returns_the_activation_dtype(norm, variant):
    # torch's CPU layer_norm/group_norm/batch_norm/rms_norm of a bfloat16 activation with
    # float32 weights: float32 inside, bfloat16 out. Before: float32 out (the float32
    # statistics promoted the result), a float32 activation where torch has a bfloat16 one.
    model = DenseThenNorm(norm)
    variables = model.init(jax.random.key(1), ACT)
    apply = lambda v, x: model.apply(v, x, mutable=["batch_stats"])
    f = cpu(apply)
    out, stats = variant(f)(variables, ACT)
    assert out.dtype == BF16
    # Running statistics stay float32: they are statistics, not the kernel's result.
    assert {a.dtype for a in jax.tree.leaves(stats)} <= {F32}
    jaxpr = jax.make_jaxpr(f)(variables, ACT)
    # Everything after the matmul computes in float32; one convert to bfloat16, at the end.
    assert not _below_float32(jaxpr, {"sub", "mul", "add", "rsqrt", "reduce_sum", "square"})
    to_low = {e.outvars[0] for e in jaxpr_eqns(jaxpr, "convert_element_type")
              if e.params["new_dtype"] == BF16}
    assert jaxpr.jaxpr.outvars[0] in to_low
    want, _ = apply(variables, ACT)
    assert rel_err(out, want) < 1e-2


def test_cuda_norm_keeps_float32_results():
    # torch's CUDA list has layer_norm and group_norm: float32 results.
    model = DenseThenNorm("LayerNorm")
    variables = model.init(jax.random.key(1), ACT)
    f = jamp.autocast(model.apply, device_type="cuda", cast_outputs=False)
    assert f(variables, ACT).dtype == F32


def test_norm_of_a_float32_activation_is_float32():
    # The kernel returns its activation's dtype: a float32 one stays float32.
    model = nn.LayerNorm()
    variables = model.init(jax.random.key(1), ACT)
    assert cpu(model.apply)(variables, ACT).dtype == F32


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("norm", ["LayerNorm", "GroupNorm", "BatchNorm", "RMSNorm"])
def test_cpu_norm_of_a_bfloat16_typed_activation_returns_bfloat16(norm, transposed):
    # torch's CPU norms of a bfloat16 tensor with float32 weights return bfloat16 whether the
    # bfloat16 came from autocast or from the program (here a cast to it). Flax casts a
    # bfloat16 input to float32 for its statistics: that cast is the kernel's own, not where
    # the activation comes from; nor is a transpose that the statistics' float32 chain moves
    # it through (channels moved last for flax). Before: float32.
    model = NORMS[norm]()
    x = ACT.reshape(4, 2, 64) if transposed else ACT
    move = (lambda x: jnp.swapaxes(x, 0, 1)) if transposed else (lambda x: x)
    variables = model.init(jax.random.key(1), move(x))
    apply = lambda v, x: model.apply(v, move(x.astype(BF16)), mutable=["batch_stats"])
    out, stats = jax.eval_shape(cpu(apply), variables, x)
    assert out.dtype == BF16
    assert {a.dtype for a in jax.tree.leaves(stats)} <= {F32}
    # The cuda table keeps its float32 results (torch's CUDA list holds layer_norm).
    if norm == "LayerNorm":
        cuda = jamp.autocast(apply, device_type="cuda", cast_outputs=False)
        assert jax.eval_shape(cuda, variables, x)[0].dtype == F32


def test_residual_after_a_norm_promotes_and_a_function_after_it_is_outside():
    # Post-norm residual: LN(x) + h with a float32 h promotes (torch: bf16 + f32 -> f32);
    # gelu(LN(x)) reads the kernel's bfloat16 result and returns bfloat16, as torch's CPU gelu
    # does (computing in float32 inside and rounding once).
    def f(x, w, h):
        a = x @ w
        mean, var = a.mean(-1, keepdims=True), a.var(-1, keepdims=True)
        y = (a - mean) * lax.rsqrt(var + 1e-5)
        return y + h, jax.nn.gelu(y)

    residual, activated = cpu(f)(ACT, W64, ACT)
    assert residual.dtype == F32 and activated.dtype == BF16
    jaxpr = jax.make_jaxpr(cpu(f))(ACT, W64, ACT)
    assert jaxpr_eqns(jaxpr, "tanh") and not _below_float32(jaxpr, {"tanh"})


def test_nnx_layer_norm_under_scan_over_layers_returns_low():
    class Block(nnx.Module):
        def __init__(self, rngs):
            self.linear = nnx.Linear(64, 64, rngs=rngs)
            self.norm = nnx.LayerNorm(64, rngs=rngs)

        def __call__(self, x):
            return self.norm(self.linear(x))

    block = Block(nnx.Rngs(0))
    f = cpu(lambda x: block(x))
    assert f(ACT).dtype == BF16
    assert jax.jit(f)(ACT).dtype == BF16


# -- float32 kernels through jits and tests --------------------------------------------------

def test_a_nested_jit_demands_what_its_float32_chain_starts_from():
    # jnp.linalg.norm is a jit whose sum is a float32 op on the cuda table: the difference
    # it is given (pdist, cdist) computes in float32 too, as if the jit were inlined.
    f = jamp.autocast(lambda a, b: jnp.linalg.norm(_lowered(a) - _lowered(b), axis=-1),
                      device_type="cuda", cast_outputs=False)
    jaxpr = jax.make_jaxpr(f)(ACT, ACT[::-1])
    assert jaxpr_eqns(jaxpr, "sub") and not _below_float32(jaxpr, {"sub", "mul"})


def test_tests_and_what_follows_a_float32_result_join_its_kernel():
    # softplus is logaddexp(x, 0): it tests isnan(x - 0) and selects x + 0 where true. Both
    # compute in float32 with the rest of its float32 kernel on the cuda table.
    f = jamp.autocast(lambda x: jax.nn.softplus(_lowered(x)), device_type="cuda",
                      cast_outputs=False)
    jaxpr = jax.make_jaxpr(f)(ACT)
    assert not _below_float32(jaxpr, {"sub", "add", "exp", "log1p", "max"})
    assert rel_err(f(ACT), jax.nn.softplus(ACT)) < 2e-3


# -- scatters --------------------------------------------------------------------------------

def _lowered(x):
    return x @ jnp.eye(x.shape[-1])    # a bfloat16 activation under autocast


@pytest.mark.parametrize("update", ["set", "add", "mul", "min", "max"])
def test_scatter_runs_in_its_operands_dtype(update, variant):
    # torch's index_put and scatter_add of bfloat16 values return bfloat16; a scatter was
    # pinned to its traced float32 before.
    idx = jnp.array([0, 2, 2])

    def f(x, v):
        return getattr(_lowered(x).at[idx], update)(_lowered(v))

    x, v = ACT[:4, :8], ACT[4:7, :8]
    out = variant(cpu(f))(x, v)
    assert out.dtype == BF16
    want = getattr(x.at[idx], update)(v)
    assert rel_err(out, want) < 2e-2


def test_scatter_promotes_a_float32_value_and_keeps_float32_zeros():
    idx = jnp.array([0, 2, 2])
    x, v = ACT[:4, :8], ACT[4:7, :8]
    # torch's index_copy promotes: a float32 value into a bfloat16 array gives float32.
    assert cpu(lambda x, v: _lowered(x).at[idx].set(v))(x, v).dtype == F32
    # A gather's gradient is scattered into float32 zeros: duplicates accumulate in float32.
    g = cpu(jax.grad(lambda x, w: jnp.sum(_lowered(x @ w)[idx] ** 2), argnums=0))
    jaxpr = jax.make_jaxpr(g)(x, W64[:8, :8])
    adds = jaxpr_eqns(jaxpr, "scatter-add")
    assert adds and all(eqn_dtypes(e)[1] == ["float32"] for e in adds)


def test_user_update_computation_keeps_its_traced_dtype():
    # `.at[].apply(fn)` carries the user's computation, typed for the traced dtypes.
    f = cpu(lambda x: _lowered(x).at[jnp.array([1])].apply(jnp.sin))
    assert f(ACT[:4, :8]).dtype == F32


# -- dot products ----------------------------------------------------------------------------

@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
def test_dot_product_of_vectors_runs_in_its_inputs_dtype(device_type):
    # torch's dot, vdot and inner are on no list: float32 vectors give float32, bfloat16 ones
    # bfloat16. A matrix product of the same values still lowers.
    a, b = ACT[0], ACT[1]
    f = jamp.autocast(jnp.dot, device_type=device_type, cast_outputs=False)
    assert f(a, b).dtype == F32
    low = jamp.autocast(lambda a, b: jnp.vdot(_lowered(a[None])[0], _lowered(b[None])[0]),
                        device_type=device_type, cast_outputs=False)
    assert low(a, b).dtype == f(ACT, W64).dtype == {"cpu": BF16, "cuda": F16}[device_type]


# -- recurrent loops -------------------------------------------------------------------------

class Recurrent(nn.Module):
    @nn.compact
    def __call__(self, x):
        y = nn.RNN(nn.LSTMCell(16))(x)
        return nn.Dense(3)(nn.RNN(nn.GRUCell(16))(y))


def _scan_types(jaxpr):
    """Per scan: the dtypes of its initial carries and of its outputs."""
    types = []
    for e in jaxpr_eqns(jaxpr, "scan"):
        _, num_consts, num_carry, _ = jx.scan_parts(e.params)
        carries = e.invars[num_consts:num_consts + num_carry]
        types.append(([str(a.aval.dtype) for a in carries],
                      [str(o.aval.dtype) for o in e.outvars]))
    return types


def test_recurrent_states_take_the_low_dtype():
    # torch's lstm/gru layers return their sequence and states in the low dtype; the scan's
    # carries settle in bfloat16 (the initial carries are cast) and the sequence is bfloat16.
    x = jax.random.normal(KEY[2], (4, 12, 8))
    model = Recurrent()
    variables = model.init(jax.random.key(1), x)
    loss = lambda v, x: jnp.mean(model.apply(v, x) ** 2)
    f = cpu(loss)
    jaxpr = jax.make_jaxpr(f)(variables, x)
    types = _scan_types(jaxpr)
    assert len(types) == 2
    assert all(set(carries) == {"bfloat16"} and set(outs) == {"bfloat16"}
               for carries, outs in types)
    grads = jax.jit(jax.grad(f))(variables, x)
    want = jax.grad(loss)(variables, x)
    flat = lambda t: jnp.concatenate([g.ravel() for g in jax.tree.leaves(t)])
    assert rel_err(flat(grads), flat(want)) < 2e-2


def test_accumulating_carry_settles_in_float32():
    # A carry the body adds to (here a running sum of bfloat16 terms) stays float32.
    def f(x, w):
        def step(acc, row):
            return acc + jnp.tanh(row @ w), None
        return lax.scan(step, jnp.zeros(w.shape[1]), x)[0]

    g = cpu(f)
    assert g(ACT, W64).dtype == F32
    assert _scan_types(jax.make_jaxpr(g)(ACT, W64)) == [(["float32"], ["float32"])]
    assert rel_err(g(ACT, W64), f(ACT, W64)) < 2e-2


def test_carry_that_does_not_settle_keeps_the_traced_interface(monkeypatch):
    # With one round allowed, a carry the body lowers has not settled: the loop keeps its
    # traced float32 interface and casts inside, as every loop did before.
    from jamp.transforms import interpreter
    monkeypatch.setattr(interpreter, "_CARRY_ROUNDS", 1)
    x = jax.random.normal(KEY[2], (4, 12, 8))
    model = Recurrent()
    variables = model.init(jax.random.key(1), x)
    f = cpu(model.apply)
    types = _scan_types(jax.make_jaxpr(f)(variables, x))
    assert types and all(set(carries) == {"float32"} for carries, _ in types)
    assert rel_err(f(variables, x), model.apply(variables, x)) < 2e-2


def test_accumulating_carries_keep_their_traced_dtype():
    # Carried in bfloat16, an Euler integration or a sum started from 0.0 stalls once its
    # steps are below bfloat16's precision; a carry the body adds to stays float32.
    w_in, w = W64[:8, :32] * 0.3, W64[:32, :32] * 0.3
    x = ACT[:4, :8]

    def euler(w_in, w, x):
        step = lambda y, _: (y + 1e-3 * jnp.tanh(y @ w), None)
        return lax.scan(step, x @ w_in, None, length=500)[0]

    def total(w, xs):
        return lax.scan(lambda c, row: (c + (row @ w)[0], None), 0.0, xs)[0]

    def clock(w, y):     # a time carried from 0.0 by a while loop
        body = lambda c: (c[0] + 0.002 / (1 + jnp.max(jnp.abs(jnp.tanh(c[1] @ w)))), c[1],
                          c[2] + 1)
        return lax.while_loop(lambda c: (c[0] < 1.0) & (c[2] < 5000), body, (0.0, y, 0))[2]

    assert rel_err(cpu(euler)(w_in, w, x), euler(w_in, w, x)) < 1e-2
    xs = jnp.abs(ACT[:, :16]) * 0.1 + 0.5
    steps = jnp.tile(xs, (64, 1))
    assert rel_err(cpu(total)(W64[:16, :16], steps), total(W64[:16, :16], steps)) < 1e-2
    assert abs(int(cpu(clock)(W64[:16, :16], xs[0])) - int(clock(W64[:16, :16], xs[0]))) < 20
    carries = _scan_types(jax.make_jaxpr(cpu(euler))(w_in, w, x))[0][0]
    assert carries == ["float32"]


@pytest.mark.parametrize("update", [
    lambda c, d, m: c + d + d,                      # two residual adds in one step
    lambda c, d, m: jnp.where(m, c + d, c),         # a masked (padded) step: a jit
    lambda c, d, m: jnp.clip(c + d, -10.0, 10.0),   # a clipped step: a jit
    lambda c, d, m: lax.stop_gradient(c) + d,
    lambda c, d, m: c.at[:].add(d),
], ids=["two_adds", "where", "clip", "stop_gradient", "scatter_add"])
def test_accumulators_written_other_ways_keep_float32(update):
    w = W64[:16, :16] * 0.1
    x0, mask = ACT[:4, :16], jnp.arange(300) % 7 != 0

    def f(x0, w, mask):
        def step(c, m):
            return update(c, 1e-3 * jnp.tanh(c @ w), m), None
        return lax.scan(step, x0 @ w, mask)[0]

    g = cpu(f)
    assert _scan_types(jax.make_jaxpr(g)(x0, w, mask))[0][0] == ["float32"]
    assert rel_err(g(x0, w, mask), f(x0, w, mask)) < 1e-2


def test_scanned_transformer_blocks_carry_their_residual_stream_in_float32():
    class Block(nn.Module):
        @nn.compact
        def __call__(self, x, _):
            h = nn.LayerNorm()(x)
            x = x + nn.MultiHeadDotProductAttention(num_heads=2)(h, h)
            x = x + nn.Dense(32)(nn.gelu(nn.Dense(64)(nn.LayerNorm()(x))))
            return x, None

    class Stack(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.Dense(32)(x)
            blocks = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True},
                             length=3)
            return blocks()(x, None)[0]

    x = jax.random.normal(KEY[3], (2, 6, 8))
    model = Stack()
    variables = model.init(jax.random.key(1), x)
    f = cpu(model.apply)
    assert [c for c, _ in _scan_types(jax.make_jaxpr(f)(variables, x))] == [["float32"]]
    assert rel_err(f(variables, x), model.apply(variables, x)) < 2e-2


def test_norm_inside_a_jit_or_remat_returns_the_activation_dtype():
    # A nested jit is transparent: the normalization inside reads the bfloat16 activation and
    # returns bfloat16, as inline; the jit's other inputs are not widened.
    ln = lambda h: (h - h.mean(-1, keepdims=True)) * lax.rsqrt(h.var(-1, keepdims=True) + 1e-5)
    for wrap in (lambda f: f, jax.jit, jax.checkpoint):
        assert cpu(lambda x, w, wrap=wrap: wrap(ln)(x @ w))(ACT, W64).dtype == BF16

    def head(logits, features):
        return jax.nn.logsumexp(logits, -1), jax.nn.gelu(features)

    for wrap in (lambda f: f, jax.jit, jax.checkpoint):
        f = jamp.autocast(lambda x, w, wrap=wrap: wrap(head)(x @ w, x @ w), device_type="cuda",
                          cast_outputs=False)
        assert [o.dtype for o in f(ACT, W64)] == [F32, F16]


@pytest.mark.parametrize("norm", sorted(NORMS))
def test_a_batch_of_one_is_a_batch(norm):
    # A (D,) scale or bias broadcast to a (1, D) activation is a weight, not a residual.
    model = DenseThenNorm(norm)
    x = ACT[:1]
    variables = model.init(jax.random.key(1), x)
    out, _ = cpu(lambda v, x: model.apply(v, x, mutable=["batch_stats"]))(variables, x)
    assert out.dtype == BF16
    dense = nn.Dense(8)
    params = dense.init(jax.random.key(1), x)
    assert cpu(dense.apply)(params, x).dtype == BF16
