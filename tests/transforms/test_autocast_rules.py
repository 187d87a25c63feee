"""Each autocast rule, read from the lowered StableHLO and the transformed jaxpr, eagerly and
under jit: lower ops, float32 ops, promotion, never-cast dtypes, scalars, explicit casts,
the weight cache, output dtypes and bad input."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jamp
from jamp.policy import FP32, LOWER, autocast_table

from helpers import (BF16, F16, F32, F64, W, X, eqn_dtypes, hlo_op_types, jaxpr_eqns,
                     lowered_op_types)


def raw(f, **kw):
    """The transformed function with outputs in the dtypes autocast computed them in."""
    return jamp.autocast(f, cast_outputs=False, **kw)


@pytest.mark.parametrize("device_type,dtype", [
    ("cpu", "bfloat16"), ("cuda", "float16"), ("gpu", "float16"), ("tpu", "bfloat16")])
def test_matmul_runs_in_each_devices_default_dtype(device_type, dtype, variant):
    f = raw(lambda x, w: x @ w, device_type=device_type)
    out = variant(f)(X, W)
    assert out.dtype == np.dtype(dtype)
    np.testing.assert_allclose(out.astype(F32), X @ W, rtol=2e-2, atol=2e-2)
    assert lowered_op_types(f, X, W, op="dot_general") == [(dtype, dtype, dtype)]


def test_float16_on_cpu_works(variant):
    f = raw(lambda x, w: x @ w, device_type="cpu", dtype=jnp.float16)
    out = variant(f)(X, W)
    assert out.dtype == F16
    np.testing.assert_allclose(out.astype(F32), X @ W, rtol=1e-2, atol=1e-2)


def test_convolution_lowers(variant):
    img = jnp.ones((1, 5, 5, 2), jnp.float32)
    ker = jnp.full((3, 3, 2, 3), 0.1, jnp.float32)

    def conv(img, ker):
        return jax.lax.conv_general_dilated(img, ker, (1, 1), "SAME",
                                            dimension_numbers=("NHWC", "HWIO", "NHWC"))

    f = raw(conv, device_type="cpu")
    assert variant(f)(img, ker).dtype == BF16
    assert lowered_op_types(f, img, ker, op="convolution") == [("bfloat16",) * 3]


def test_fp32_ops_run_in_float32_on_cuda_table(variant):
    # exp, log and sum are on torch's CUDA float32 list; their input here is a float16 matmul.
    def f(x, w):
        h = x @ w
        return jnp.exp(h), jnp.log(jnp.abs(h) + 1.0), jnp.sum(h, axis=0)

    g = raw(f, device_type="cuda")
    outs = variant(g)(X, W)
    assert [o.dtype for o in outs] == [F32, F32, F32]
    text = jax.jit(g).lower(X, W).as_text()
    assert hlo_op_types(text, "exponential") == [("float32",) * 1]
    assert hlo_op_types(text, "log") == [("float32",)]
    assert [t for t in hlo_op_types(text, "reduce")] == [("float32", "float32", "float32")]
    chex.assert_trees_all_close(outs, f(X, W), rtol=2e-2, atol=2e-2)


def test_cpu_table_follows_torchs_cpu_list():
    # torch's CPU list has no exp or sum: they follow their bfloat16 input; prod is float32.
    def f(x, w):
        h = x @ w
        return jnp.exp(h), jnp.sum(h, axis=0), jnp.prod(h, axis=0)

    outs = raw(f, device_type="cpu")(X, W)
    assert [o.dtype for o in outs] == [BF16, BF16, F32]
    # The bfloat16 sum accumulates in float32 and returns bfloat16, as torch's CPU kernel does.
    text = jax.jit(raw(f, device_type="cpu")).lower(X, W).as_text()
    reduces = hlo_op_types(text, "reduce")
    assert ("float32", "float32", "float32") in reduces
    assert hlo_op_types(text, "exponential") == [("bfloat16",)]


def test_softmax_in_float32_on_cuda():
    f = raw(lambda x, w: jax.nn.softmax(x @ w), device_type="cuda")
    jaxpr = jax.make_jaxpr(f)(X, W)
    exps = jaxpr_eqns(jaxpr, "exp")
    assert exps and all(eqn_dtypes(e) == (["float32"], ["float32"]) for e in exps)
    assert f(X, W).dtype == F32


def test_other_ops_run_in_widest_input(variant):
    def f(x, w):
        low = x @ w           # bfloat16
        return low + x, jnp.tanh(low), jnp.maximum(low, x)

    outs = variant(raw(f, device_type="cpu"))(X, W)
    assert [o.dtype for o in outs] == [F32, BF16, F32]
    text = jax.jit(raw(f, device_type="cpu")).lower(X, W).as_text()
    assert hlo_op_types(text, "add") == [("float32",)]
    assert hlo_op_types(text, "tanh") == [("bfloat16",)]


def test_float16_and_bfloat16_promote_to_float32():
    def f(x, w):
        with jamp.autocast(dtype=jnp.float16):
            a = x @ w
        return a + x @ w

    assert raw(f, device_type="cpu")(X, W).dtype == F32


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.bool_, jnp.complex64])
def test_non_floating_values_are_never_cast(dtype, variant):
    a = jnp.ones((3, 4), dtype)
    f = raw(lambda a, x, w: (a * a, (x @ w) * 2.0), device_type="cpu")
    outs = variant(f)(a, X, W)
    assert outs[0].dtype == np.dtype(dtype)
    assert outs[1].dtype == BF16


def test_float64_is_never_cast(variant):
    with jax.enable_x64(True):
        x64, w64 = X.astype(jnp.float64), W.astype(jnp.float64)
        f = raw(lambda x, w: jnp.exp(x @ w), device_type="cuda")
        assert variant(f)(x64, w64).dtype == F64
        assert lowered_op_types(f, x64, w64, op="dot_general") == [("float64",) * 3]


def test_python_scalars_follow_and_never_widen(variant):
    f = raw(lambda x, w: (x @ w) * 2.0 + 1.0, device_type="cpu")
    out = variant(f)(X, W)
    assert out.dtype == BF16
    text = jax.jit(f).lower(X, W).as_text()
    assert hlo_op_types(text, "multiply") == [("bfloat16",)]
    assert hlo_op_types(text, "convert") == [("float32", "bfloat16")] * 2


def test_weak_typed_argument_follows(variant):
    f = raw(lambda x, w, s: (x @ w) * s, device_type="cpu")
    # jnp.asarray(3.0) is weak-typed, like the Python scalar it came from: it follows.
    assert variant(f)(X, W, jnp.asarray(3.0)).dtype == BF16
    # A float32 scalar array with a dtype of its own promotes like any float32 array...
    g = raw(lambda x, s: x.astype(jnp.bfloat16) * s, device_type="cpu")
    assert variant(g)(X, jnp.asarray(3.0, jnp.float32)).dtype == F32
    # ...but a weight that scales a linear layer's result follows it (torch's kernel epilogue).
    assert variant(f)(X, W, jnp.asarray(3.0, jnp.float32)).dtype == BF16
    # A Python float argument is static (not traced): it behaves like a literal.
    assert f(X, W, 3.0).dtype == BF16


def test_explicit_user_casts_are_honoured(variant):
    # A cast is honoured where it is in the traced program. (`astype(float32)` of a value
    # that is float32 when traced leaves no trace, so there is nothing to honour.)
    def f(x, w):
        h = (x.astype(jnp.bfloat16) @ w.astype(jnp.bfloat16)).astype(jnp.float32)
        return h, jnp.tanh(h), x.astype(jnp.bfloat16) * 2.0, (x @ w).astype(jnp.float16)

    outs = variant(raw(f, device_type="cpu"))(X, W)
    assert [o.dtype for o in outs] == [F32, F32, BF16, F16]


def test_explicit_preferred_element_type_is_kept():
    f = raw(lambda x, w: jax.lax.dot(x.astype(jnp.bfloat16), w.astype(jnp.bfloat16),
                                     preferred_element_type=jnp.float32), device_type="cuda")
    # Written in bfloat16 with a float32 accumulator: autocast lowers the inputs to float16
    # but keeps the user's float32 result.
    assert lowered_op_types(f, X, W, op="dot_general") == [
        ("float16", "float16", "float32")]


def test_each_weight_is_cast_once_with_cache():
    def f(x, w):
        return (x @ w) @ w + x @ w

    cached = jax.make_jaxpr(raw(f, device_type="cpu"))(X, W)
    uncached = jax.make_jaxpr(raw(f, device_type="cpu", cache_enabled=False))(X, W)
    to_bf16 = lambda j: [e for e in jaxpr_eqns(j, "convert_element_type")
                         if e.params["new_dtype"] == BF16]
    assert len(to_bf16(cached)) == 2      # x and w once each
    assert len(to_bf16(uncached)) == 5    # per use
    np.testing.assert_array_equal(raw(f, device_type="cpu")(X, W),
                                  raw(f, device_type="cpu", cache_enabled=False)(X, W))


def test_outputs_in_original_dtypes_unless_opted_out(variant):
    f = lambda x, w: {"logits": x @ w, "n": jnp.arange(3)}
    kept = variant(jamp.autocast(f, device_type="cpu"))(X, W)
    low = variant(jamp.autocast(f, device_type="cpu", cast_outputs=False))(X, W)
    assert kept["logits"].dtype == F32 and low["logits"].dtype == BF16
    assert kept["n"].dtype == low["n"].dtype == jnp.arange(3).dtype


def test_disabled_transform_is_the_function():
    f = lambda x, w: x @ w
    g = jamp.autocast(f, enabled=False)
    assert g(X, W).dtype == F32
    np.testing.assert_array_equal(g(X, W), f(X, W))


def test_decorator_form():
    @jamp.autocast(device_type="cpu", cast_outputs=False)
    def f(x, w):
        return x @ w

    assert f(X, W).dtype == BF16


def test_default_device_type_is_the_backend():
    region = jamp.autocast()
    assert region.device_type == {"gpu": "cuda"}.get(jax.default_backend(),
                                                      jax.default_backend())
    assert region.dtype == autocast_table(region.device_type).default_dtype


def test_custom_table_adds_drops_and_pins():
    table = autocast_table("cpu").updated({"tanh": FP32, "exp": LOWER,
                                           "dot_general": "float16"})
    f = raw(lambda x, w: (x @ w, jnp.tanh(x), jnp.exp(x)), op_table=table)
    assert [o.dtype for o in f(X, W)] == [F16, F32, BF16]
    dropped = raw(lambda x, w: x @ w, op_table=autocast_table("cpu").without("dot_general"))
    assert dropped(X, W).dtype == F32


@pytest.mark.parametrize("bad", ["xpu", "cuda:0", "", None])
def test_unknown_device_type_is_refused(bad):
    if bad is None:  # a wrong type
        with pytest.raises(TypeError, match="device_type=3"):
            jamp.autocast(device_type=3)
        return
    with pytest.raises(ValueError, match=r"Unknown autocast device_type .*"
                                         r"'cuda', 'gpu', 'rocm', 'cpu', 'tpu'"):
        jamp.autocast(device_type=bad)


@pytest.mark.parametrize("bad", [jnp.int32, "int8", jnp.bool_, "float64", jnp.complex64, "fp8"])
def test_non_floating_dtype_is_refused(bad):
    with pytest.raises(ValueError, match=r"float16, bfloat16, float32"):
        jamp.autocast(lambda x: x, dtype=bad)


def test_bad_table_rule_is_refused():
    accepted = "'lower', 'fp32', 'accumulate_fp32', 'fp32_statistics' or a floating dtype"
    with pytest.raises(ValueError, match=accepted):
        autocast_table("cpu").updated({"exp": "int32"})


def test_float32_operand_of_a_float64_matmul_is_not_rounded(variant):
    # jnp lets a float32 array meet a float64 one in one dot_general: the op runs as written.
    with jax.enable_x64(True):
        w64 = W.astype(jnp.float64) / 3.0
        f = jamp.autocast(lambda x, w: x @ w, device_type="cpu")
        out = variant(f)(X, w64)
        assert out.dtype == F64
        np.testing.assert_allclose(out, np.asarray(X, np.float64) @ np.asarray(w64), rtol=1e-6)
        dots = jaxpr_eqns(jax.make_jaxpr(f)(X, w64), "dot_general")
        assert [eqn_dtypes(e) for e in dots] == [(["float32", "float64"], ["float64"])]
        assert "bf16" not in jax.jit(f).lower(X, w64).as_text()


@pytest.mark.parametrize("callback", ["pure_callback", "io_callback"])
def test_callbacks_receive_their_traced_dtypes(callback, variant):
    from jax.experimental import io_callback

    seen = []

    def host(a):
        seen.append(np.asarray(a).dtype)
        return np.asarray(a) * 2

    def f(x, w):
        h = x @ w   # bfloat16 under autocast; the callback was traced for float32
        spec = jax.ShapeDtypeStruct(h.shape, h.dtype)
        if callback == "pure_callback":
            return jax.pure_callback(host, spec, h)
        return io_callback(host, spec, h)

    out = variant(jamp.autocast(f, device_type="cpu", cast_outputs=False))(X, W)
    assert seen == [F32] and out.dtype == F32
    np.testing.assert_allclose(out, 2 * (X @ W), rtol=2e-2, atol=2e-2)
