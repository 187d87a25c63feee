"""jmp's loss scales: the same values, dtypes and pytree leaves as jmp, eagerly and under jit."""

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import jmp
import numpy as np
import pytest

import jamp.scaler as js

from helpers import assert_trees_equal

# (name, jmp factory, jamp factory): the same loss scale built the same way in both libraries.
LOSS_SCALES = [
    ("noop", lambda m: m.NoOpLossScale()),
    ("static", lambda m: m.StaticLossScale(jnp.float32(2.0**10))),
    ("dynamic", lambda m: m.DynamicLossScale(jnp.float32(2.0**15))),
    ("dynamic_p3_f4", lambda m: m.DynamicLossScale(jnp.float32(8.0), period=3, factor=4)),
]

TREE = {"a": jnp.array([1.5, -2.0, 3.0], jnp.float32), "b": (jnp.float32(0.25),)}


@pytest.mark.parametrize("name,make", LOSS_SCALES, ids=[n for n, _ in LOSS_SCALES])
def test_scale_unscale_match_jmp(name, make, variant):
    ours, theirs = make(js), make(jmp)
    scaled = variant(lambda ls, t: ls.scale(t))(ours, TREE)
    assert_trees_equal(scaled, theirs.scale(TREE))
    unscaled = variant(lambda ls, t: ls.unscale(t))(ours, scaled)
    assert_trees_equal(unscaled, theirs.unscale(theirs.scale(TREE)))
    assert np.asarray(ours.loss_scale) == np.asarray(theirs.loss_scale)


@pytest.mark.parametrize("name,make", LOSS_SCALES, ids=[n for n, _ in LOSS_SCALES])
def test_pytree_leaves_match_jmp(name, make):
    ours, theirs = make(js), make(jmp)
    ours_leaves = jax.tree_util.tree_leaves(ours)
    theirs_leaves = jax.tree_util.tree_leaves(theirs)
    assert len(ours_leaves) == len(theirs_leaves)
    for a, b in zip(ours_leaves, theirs_leaves):
        assert np.asarray(a).dtype == np.asarray(b).dtype
        np.testing.assert_array_equal(a, b)


def test_dynamic_fields_and_defaults_match_jmp():
    ours = js.DynamicLossScale(jnp.float32(4.0))
    theirs = jmp.DynamicLossScale(jnp.float32(4.0))
    for field in ("counter", "period", "factor", "min_loss_scale"):
        a, b = getattr(ours, field), getattr(theirs, field)
        np.testing.assert_array_equal(a, b)
        assert np.asarray(a).dtype == np.asarray(b).dtype, field
    assert ours.max_loss_scale is None


def test_dynamic_adjust_trajectory_matches_jmp(variant):
    rng = np.random.default_rng(0)
    finites = rng.random(300) < 0.9
    ours = js.DynamicLossScale(jnp.float32(2.0**15), period=5)
    theirs = jmp.DynamicLossScale(jnp.float32(2.0**15), period=5)
    adjust = variant(lambda ls, f: ls.adjust(f))
    for f in finites:
        ours = adjust(ours, jnp.asarray(f))
        theirs = theirs.adjust(jnp.asarray(f))
        assert np.asarray(ours.loss_scale) == np.asarray(theirs.loss_scale)
        assert int(ours.counter) == int(theirs.counter)
        assert ours.loss_scale.dtype == theirs.loss_scale.dtype
        assert ours.counter.dtype == theirs.counter.dtype


def test_dynamic_rule_by_hand():
    ls = js.DynamicLossScale(jnp.float32(16.0), period=2, factor=2)
    ls = ls.adjust(jnp.array(True))
    assert (float(ls.loss_scale), int(ls.counter)) == (16.0, 1)
    ls = ls.adjust(jnp.array(True))  # second finite step in a row: grow, counter back to 0
    assert (float(ls.loss_scale), int(ls.counter)) == (32.0, 0)
    ls = ls.adjust(jnp.array(False))
    assert (float(ls.loss_scale), int(ls.counter)) == (16.0, 0)


def test_dynamic_never_grows_to_inf():
    big = jnp.float32(np.finfo(np.float32).max / 1.5)
    ls = js.DynamicLossScale(big, period=1).adjust(jnp.array(True))
    assert float(ls.loss_scale) == float(big)


def test_min_loss_scale_floors_and_survives_jit():
    ls = js.DynamicLossScale(jnp.float32(8.0), min_loss_scale=np.float32(4.0))
    step = jax.jit(lambda ls: ls.adjust(jnp.array(False)))
    ls = step(step(step(ls)))
    assert float(ls.loss_scale) == 4.0
    assert float(ls.min_loss_scale) == 4.0


def test_max_loss_scale_is_a_ceiling():
    ls = js.DynamicLossScale(jnp.float32(2.0**23), period=1, max_loss_scale=2.0**24)
    step = jax.jit(lambda ls: ls.adjust(jnp.array(True)))
    ls = step(step(step(ls)))
    assert float(ls.loss_scale) == 2.0**24
    assert ls.max_loss_scale == 2.0**24


def test_static_loss_scale_crosses_jit_as_static_data():
    ls = js.StaticLossScale(jnp.float32(128.0))
    out = jax.jit(lambda ls, x: ls.scale(x))(ls, jnp.float32(2.0))
    assert float(out) == 256.0
    assert ls == js.StaticLossScale(jnp.float32(128.0))
    assert hash(ls) == hash(js.StaticLossScale(np.float32(128.0)))
    assert ls != js.StaticLossScale(jnp.float32(64.0))


def test_noop_loss_scale():
    ls = js.NoOpLossScale()
    assert ls.loss_scale == 1
    assert ls.scale(TREE) is TREE and ls.unscale(TREE) is TREE
    assert ls.adjust(jnp.array(False)) is ls


def test_jmp_accepts_zero_scales_and_so_does_jamp():
    zero = js.StaticLossScale(0.0)
    assert float(zero.scale(jnp.float32(3.0))) == 0.0
    dyn = js.DynamicLossScale(jnp.float32(4.0), min_loss_scale=jnp.float32(0.0), factor=2)
    for _ in range(4):
        dyn = dyn.adjust(False)
    assert float(dyn.loss_scale) == 0.25


@pytest.mark.parametrize("tree,expected", [
    ({"a": jnp.ones(3), "b": jnp.zeros(2)}, True),
    ({"a": jnp.array([1.0, jnp.inf]), "b": jnp.zeros(2)}, False),
    ({"a": jnp.ones(3), "b": jnp.array([jnp.nan])}, False),
    ({"a": jnp.array([-jnp.inf], jnp.float16)}, False),
    ({"a": jnp.array([1.0], jnp.bfloat16), "b": jnp.ones(2, jnp.float16)}, True),
    ({}, True),
    ({"step": jnp.array(3, jnp.int32), "mask": jnp.array([True, False]), "none": None}, True),
    ({"step": 7, "w": jnp.ones(2)}, True),
    ({"step": 7, "w": jnp.array([jnp.nan], jnp.float16)}, False),
    ({"empty": jnp.zeros((0, 3)), "w": jnp.ones(2)}, True),
    ({"w": jnp.array([jnp.nan, 1.0, jnp.inf, -3.0])}, False),
    ({"w": jnp.array([[1.0, 2.0], [jnp.nan, 4.0]], jnp.bfloat16)}, False),
    ({"w": jnp.full((3,), np.finfo(np.float32).max)}, True),
], ids=["finite", "inf", "nan", "f16-neg-inf", "bf16-f16", "empty", "int-bool-none",
        "python-int", "python-int-f16-nan", "zero-size", "nan-first", "bf16-nan-2d",
        "float32-max"])
def test_all_finite(tree, expected, variant):
    got = variant(js.all_finite)(tree)
    assert got.shape == () and got.dtype == jnp.bool_
    assert bool(got) is expected


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16, jnp.bfloat16])
@pytest.mark.parametrize("shape", [(128, 512), (3, 64, 32), (1000,), (33, 17)])
def test_all_finite_sees_one_bad_element_anywhere(shape, dtype):
    # Large leaves go through XLA's vectorized reductions, where a max-based check can drop a
    # nan on the CPU; every position and every kind of bad value must be seen.
    check = jax.jit(js.all_finite)
    size = int(np.prod(shape))
    positions = np.unique(np.concatenate([
        [0, 1, size // 2, size - 2, size - 1],
        np.random.default_rng(size).choice(size, 40, replace=False)]))
    good = np.full(size, 0.5, np.float32)
    assert bool(check({"w": jnp.asarray(good.reshape(shape), dtype)}))
    missed = []
    for bad in (np.nan, np.inf, -np.inf):
        for i in positions:
            x = good.copy()
            x[i] = bad
            if bool(check({"w": jnp.asarray(x.reshape(shape), dtype), "b": jnp.ones(3)})):
                missed.append((bad, int(i)))
    assert not missed, f"all_finite missed {len(missed)} bad elements, e.g. {missed[:5]}"


def test_all_finite_over_leaves_that_share_a_shape():
    # Same-shaped leaves are checked in one reduction; a bad value in any one of them, or in
    # a same-shaped leaf of another dtype, a scalar or a Python float, must still be seen.
    good = {"same": [jnp.full((64, 48), 0.5) for _ in range(5)],
            "half": jnp.full((64, 48), 0.5, jnp.float16),
            "scalar": jnp.float32(2.0), "python": 3.0, "step": jnp.int32(7)}
    check = jax.jit(js.all_finite)
    assert bool(check(good))
    for k in range(5):
        for bad in (np.nan, np.inf, -np.inf):
            tree = {**good, "same": list(good["same"])}
            tree["same"][k] = tree["same"][k].at[k, 3 * k].set(bad)
            assert not bool(check(tree)), (k, bad)
    assert not bool(check({**good, "half": good["half"].at[63, 47].set(jnp.inf)}))
    assert not bool(check({**good, "scalar": jnp.float32(np.nan)}))
    assert not bool(js.all_finite({**good, "python": float("inf")}))


def test_all_finite_under_vmap_is_per_example():
    x = jnp.ones((4, 3, 5))
    tree = {"a": x, "b": x.at[2, 1, 1].set(jnp.nan), "c": x.astype(jnp.float16)}
    got = jax.jit(jax.vmap(js.all_finite))(tree)
    np.testing.assert_array_equal(np.asarray(got), [True, True, False, True])


def test_all_finite_of_huge_finite_values_is_true():
    # The check never overflows: finite values at the top of each format stay finite.
    tree = {"f16": jnp.full((4096,), np.finfo(np.float16).max, jnp.float16),
            "bf16": jnp.full((4096,), -jnp.finfo(jnp.bfloat16).max, jnp.bfloat16),
            "f32": jnp.full((4096,), np.finfo(np.float32).max)}
    assert bool(jax.jit(js.all_finite)(tree))


def test_all_finite_matches_jmp_on_float_trees():
    for tree in ({"a": jnp.ones(3)}, {"a": jnp.array([jnp.nan])}, [jnp.ones(2), jnp.inf]):
        assert bool(js.all_finite(tree)) == bool(jmp.all_finite(tree))


@pytest.mark.parametrize("value", [complex(np.inf, 0), complex(0, np.nan), complex(np.nan, 1)])
def test_all_finite_reads_both_parts_of_complex_leaves(value):
    assert not bool(js.all_finite({"z": jnp.array([1j, value], jnp.complex64)}))
    assert bool(js.all_finite({"z": jnp.array([1j, 2 + 0j], jnp.complex64)}))
    scaler = js.GradScaler()
    _, found_inf = scaler.unscale(scaler.init(), {"z": jnp.array([value], jnp.complex64)})
    assert bool(found_inf)


def test_select_tree(variant):
    a = {"w": jnp.ones(3), "count": jnp.array(1, jnp.int32)}
    b = {"w": jnp.zeros(3), "count": jnp.array(2, jnp.int32)}
    pick = variant(js.select_tree)
    assert_trees_equal(pick(jnp.array(True), a, b), a)
    assert_trees_equal(pick(jnp.array(False), a, b), b)
    assert_trees_equal(js.select_tree(jnp.array(False), a, b),
               jmp.select_tree(jnp.array(False), a, b))


def test_select_tree_rejects_non_scalar_bool():
    with pytest.raises(ValueError, match="boolean scalar"):
        js.select_tree(jnp.array([True]), 1.0, 2.0)
    with pytest.raises(AssertionError, match="int32"):  # jmp's callers catch AssertionError
        js.select_tree(jnp.array(1), 1.0, 2.0)


def test_non_floating_leaves_pass_through(variant):
    ls = js.DynamicLossScale(jnp.float32(4.0))
    tree = {"w": jnp.ones(2, jnp.float32), "step": jnp.array(3, jnp.int32),
            "mask": jnp.array([True]), "n": None}
    out = variant(lambda ls, t: ls.unscale(ls.scale(t)))(ls, tree)
    assert out["step"].dtype == jnp.int32 and int(out["step"]) == 3
    assert out["mask"].dtype == jnp.bool_ and out["n"] is None
    np.testing.assert_array_equal(out["w"], tree["w"])


def test_mixed_half_and_float_grads_follow_jmp_dtypes():
    ls = js.DynamicLossScale(jnp.float32(1024.0))
    tree = {"h": jnp.array([0.5, 2.0], jnp.float16), "f": jnp.array([3.0], jnp.float32)}
    got, want = ls.unscale(tree), jmp.DynamicLossScale(jnp.float32(1024.0)).unscale(tree)
    for k in tree:
        assert got[k].dtype == want[k].dtype
        np.testing.assert_array_equal(got[k], want[k])


BAD = [
    (lambda: js.DynamicLossScale(jnp.float32(-1.0)), r"loss_scale.*>= 0.*-1"),
    (lambda: js.DynamicLossScale(jnp.float32(np.inf)), r"loss_scale.*finite"),
    (lambda: js.StaticLossScale(-2.0), r"loss_scale=-2.0"),
    (lambda: js.DynamicLossScale(jnp.float32(1.0), period=2.5), r"period.*integer.*2.5"),
    (lambda: js.DynamicLossScale(jnp.float32(1.0), period=0), r"period.*>= 1.*0"),
    (lambda: js.DynamicLossScale(jnp.float32(1.0), factor=1), r"factor.*> 1.*1"),
    (lambda: js.DynamicLossScale(jnp.float32(1.0), min_loss_scale=-1.0), r"min_loss_scale=-1.0"),
    (lambda: js.DynamicLossScale(jnp.float32(8.0), min_loss_scale=4.0, max_loss_scale=2.0),
     r"max_loss_scale.*>= min_loss_scale"),
]


@pytest.mark.parametrize("make,message", BAD, ids=[m for _, m in BAD])
def test_bad_settings_raise_value_error(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_traced_loss_scale_is_not_validated():
    # Inside jit the scale is a tracer: building the object must not try to read it.
    out = jax.jit(lambda s: js.DynamicLossScale(s).scale(jnp.float32(2.0)))(jnp.float32(3.0))
    assert float(out) == 6.0


def test_integer_loss_scale_warns_like_jmp():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        js.DynamicLossScale(jnp.asarray(2**15))
    assert any("Expected floating type for loss_scale" in str(w.message) for w in caught)


def test_code_written_against_jmp_runs_by_changing_the_import():
    def train(mp):  # a jmp-style training loop body, parametrized by the module
        ls = mp.DynamicLossScale(jnp.float32(2.0**15), period=2)
        params = jnp.ones(3)
        for x in (1.0, np.inf, 1.0, 1.0, 1.0):
            grads = jax.grad(lambda p: ls.scale(jnp.sum(p * x)))(params)
            grads = ls.unscale(grads)
            finite = mp.all_finite(grads)
            ls = ls.adjust(finite)
            params = mp.select_tree(finite, params - 0.1 * grads, params)
        return params, ls.loss_scale, ls.counter

    for a, b in zip(train(js), train(jmp)):
        np.testing.assert_array_equal(a, b)


def test_dynamic_is_a_frozen_dataclass_like_jmp():
    ls = js.DynamicLossScale(jnp.float32(2.0))
    with pytest.raises(dataclasses.FrozenInstanceError):
        ls.period = 3


def test_static_equality_distinguishes_python_and_array_scales():
    # Equal objects share a jit cache entry, so they must also give equal dtypes.
    assert js.StaticLossScale(128.0) != js.StaticLossScale(jnp.float32(128.0))
    half = jnp.ones(2, jnp.float16)
    f = jax.jit(lambda ls, x: ls.scale(x))
    assert f(js.StaticLossScale(128.0), half).dtype == jnp.float16
    assert f(js.StaticLossScale(jnp.float32(128.0)), half).dtype == jnp.float32


def test_python_number_settings_stay_python_numbers_through_jit():
    ls = js.DynamicLossScale(jnp.float32(2.0), min_loss_scale=0.5, max_loss_scale=2.0**24)
    out = jax.jit(lambda ls: ls)(ls)
    assert type(out.min_loss_scale) is float and type(out.max_loss_scale) is float
    assert out.min_loss_scale == 0.5 and out.max_loss_scale == 2.0**24
