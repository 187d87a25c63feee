"""amp_report on fp8 programs: the share of matmul FLOPs on float8 operands (emulated GEMMs
included) and the casts to float8 with their bytes."""

import json

import jax
import jax.numpy as jnp

import jamp
from jamp.profile import amp_report

DENSE = (((1,), (0,)), ((), ()))


def _step(recipe):
    w2 = jnp.ones((16, 4))

    def loss(w, x):
        h = jamp.fp8.dot_general(x, w, DENSE, recipe)
        return jnp.mean((h @ w2) ** 2)  # a float32 matmul beside the fp8 one
    return jax.grad(loss, argnums=(0, 1))


def test_fp8_share_and_casts_of_a_tensorwise_step():
    w, x = jnp.ones((32, 16)), jnp.ones((8, 32))
    report = amp_report(_step(jamp.fp8.recipe("tensorwise")), w, x)
    gemm = 2 * 8 * 32 * 16  # each of the fp8 layer's three GEMMs
    # The output GEMM on e4m3 operands; both gradient GEMMs meet e5m2 (the output gradient).
    assert report.flops["float8_e4m3fn"] == gemm
    assert report.flops["float8_e5m2"] == 2 * gemm
    assert report.fp8_flops_fraction == 3 * gemm / sum(report.flops.values())
    assert report.half_flops_fraction == 0.0
    # x and w cast for the output GEMM and each re-cast for one gradient GEMM; the output
    # gradient cast to e5m2 for each gradient GEMM.
    casts = {(c.target, c.count, c.bytes) for c in report.fp8_casts}
    assert casts == {("float8_e4m3fn", 4, 2 * (8 * 32) + 2 * (32 * 16)),
                     ("float8_e5m2", 2, 2 * 8 * 16)}
    assert report.fp8_cast_bytes == sum(c[2] for c in casts)
    assert "fp8_flops_fraction 0.9" in report.table()
    assert json.loads(json.dumps(report.to_dict()))["fp8_cast_bytes"] == report.fp8_cast_bytes


def test_rowwise_with_gw_hp_keeps_the_weight_gradient_gemm_out_of_the_fp8_share():
    w, x = jnp.ones((32, 16)), jnp.ones((8, 32))
    report = amp_report(_step(jamp.fp8.recipe("rowwise_with_gw_hp")), w, x)
    gemm = 2 * 8 * 32 * 16
    assert report.flops["float8_e4m3fn"] == 2 * gemm
    assert report.fp8_flops_fraction == 2 * gemm / sum(report.flops.values())


def test_a_program_without_fp8_has_none():
    w, x = jnp.ones((32, 16)), jnp.ones((8, 32))
    report = amp_report(jamp.autocast(lambda w, x: jnp.sum(x @ w), dtype=jnp.bfloat16), w, x)
    assert report.fp8_flops_fraction == 0.0 and report.fp8_casts == ()
    assert "fp8" not in report.table()
