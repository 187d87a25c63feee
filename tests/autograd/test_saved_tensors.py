"""jamp.autograd.graph: saved_tensors_hooks, save_on_cpu, disable_saved_tensors_hooks, save_as.

Each hook pair wraps a function; the residuals of its backward pass through the hooks. Tests run
eagerly and under jit (the `variant` fixture) and compare gradients with plain `jax.grad`.
"""


import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jamp
from jamp.autograd.graph import (
    disable_saved_tensors_hooks,
    save_as,
    save_on_cpu,
    saved_tensors_hooks,
)


def mlp(params, x):
    for w in params:
        x = jnp.tanh(x @ w)
    return jnp.sum(x ** 2)


def make_params(width=8, depth=3):
    keys = jax.random.split(jax.random.key(0), depth + 1)
    params = [jax.random.normal(k, (width, width)) / np.sqrt(width) for k in keys[:-1]]
    return params, jax.random.normal(keys[-1], (4, width))


def counting(log, name="hooks"):
    """Identity hooks that record (event, name, dtype) for every residual."""
    def pack(x):
        log.append(("pack", name, x.dtype))
        return x

    def unpack(x):
        log.append(("unpack", name, x.dtype))
        return x

    return saved_tensors_hooks(pack, unpack)


def array_leaves(tree):
    return [x for x in jax.tree_util.tree_leaves(tree) if isinstance(x, jax.Array)]


# -- saved_tensors_hooks ------------------------------------------------------------------------

def test_every_residual_is_packed_and_unpacked_once(variant):
    params, x = make_params()
    _, plain_pullback = jax.vjp(mlp, params, x)
    log = []
    grad = variant(jax.grad(counting(log)(mlp), argnums=(0, 1)))
    grad(params, x)
    packs = [e for e in log if e[0] == "pack"]
    unpacks = [e for e in log if e[0] == "unpack"]
    assert len(packs) == len(array_leaves(plain_pullback)) > 0
    assert len(unpacks) == len(packs)
    assert log.index(unpacks[0]) > log.index(packs[-1])  # all stored before any is used


def test_only_residuals_of_differentiated_inputs_are_saved():
    params, x = make_params()
    log = []
    jax.grad(counting(log)(mlp))(params, x)  # not with respect to x
    _, pullback = jax.vjp(lambda p: mlp(p, x), params)
    assert len([e for e in log if e[0] == "pack"]) == len(array_leaves(pullback))


def test_identity_hooks_leave_gradients_unchanged(variant):
    params, x = make_params()
    hooked = saved_tensors_hooks(lambda t: t, lambda t: t)(mlp)
    got = variant(jax.grad(hooked, argnums=(0, 1)))(params, x)
    want = variant(jax.grad(mlp, argnums=(0, 1)))(params, x)
    chex.assert_trees_all_equal(got, want)


def test_hooked_function_without_differentiation_runs_as_is(variant):
    params, x = make_params()
    log = []
    # Against `mlp` run the same way: compiled, this loss may round differently from eager
    # dispatch, hooks or not (whether it does depends on XLA's CPU emitters, which jaxlib 0.11
    # changed).
    want = variant(mlp)(params, x)
    np.testing.assert_array_equal(variant(counting(log)(mlp))(params, x), want)
    assert log == []


def test_decorator_form_and_pytree_of_packed_values():
    # pack may return any pytree: arrays travel as residuals, other leaves come back as they were
    @saved_tensors_hooks(lambda t: {"value": t * 2.0, "tag": "doubled"},
                         lambda p: p["value"] / 2.0 if p["tag"] == "doubled" else None)
    def f(x, y):
        return jnp.sum(jnp.sin(x) * y)

    x, y = jnp.arange(3.0), jnp.ones(3)
    got = jax.jit(jax.grad(f, argnums=(0, 1)))(x, y)
    want = jax.grad(lambda x, y: jnp.sum(jnp.sin(x) * y), argnums=(0, 1))(x, y)
    chex.assert_trees_all_close(got, want, rtol=1e-7)


def test_static_arguments_keywords_and_integer_inputs(variant):
    def f(x, idx, *, scale, name):
        assert name == "gather"
        return jnp.sum(x[idx] * scale)

    log = []
    hooked = counting(log)(f)
    x, idx = jnp.arange(4.0), jnp.array([0, 2, 2])
    got = variant(jax.grad(lambda x: hooked(x, idx, scale=3.0, name="gather")))(x)
    np.testing.assert_array_equal(got, [3.0, 0.0, 6.0, 0.0])


def test_vmap_and_grad_of_grad():
    hooked = saved_tensors_hooks(lambda t: t, lambda t: t)(lambda x: jnp.sum(jnp.sin(x) ** 2))
    plain = lambda x: jnp.sum(jnp.sin(x) ** 2)  # noqa: E731
    xs = jnp.linspace(0.0, 1.0, 6).reshape(2, 3)
    np.testing.assert_allclose(jax.vmap(jax.grad(hooked))(xs), jax.vmap(jax.grad(plain))(xs))
    second = lambda f: jax.grad(lambda x: jnp.sum(jax.grad(f)(x)))  # noqa: E731
    np.testing.assert_allclose(second(hooked)(xs[0]), second(plain)(xs[0]), rtol=1e-6)


def test_nested_hooks_innermost_wins(variant):
    inner = save_as(jnp.bfloat16)(lambda x: jnp.sin(x) * x)
    middle_log, outer_log = [], []
    middle = counting(middle_log, "middle")(lambda x: inner(x))
    outer = counting(outer_log, "outer")(lambda x: jnp.sum(middle(x * 2.0) * jnp.cos(x)))
    x = jnp.linspace(0.1, 1.0, 5)
    variant(jax.grad(outer))(x)
    # save_as, innermost, stored the inner residuals; the pairs around it leave them alone
    assert middle_log == []
    _, inner_pullback = jax.vjp(lambda x: jnp.sin(x) * x, x)
    _, stored = jax.vjp(outer, x)  # the outer custom_vjp's stored values
    bf16 = [a for a in array_leaves(stored) if a.dtype == jnp.bfloat16]
    assert len(bf16) == len(array_leaves(inner_pullback))
    outer_packs = [e for e in outer_log if e[0] == "pack"]
    assert outer_packs and all(dtype == jnp.float32 for _, _, dtype in outer_packs)


def test_nested_hooks_count_each_residual_once():
    inner_log, outer_log = [], []
    inner = counting(inner_log, "inner")(lambda x: jnp.sin(x) * x)
    outer = counting(outer_log, "outer")(lambda x: jnp.sum(inner(x * 2.0) * jnp.cos(x)))
    x = jnp.linspace(0.1, 1.0, 5)
    _, stored = jax.vjp(outer, x)
    _, inner_pullback = jax.vjp(lambda x: jnp.sin(x) * x, x)
    inner_packs = [e for e in inner_log if e[0] == "pack"]
    outer_packs = [e for e in outer_log if e[0] == "pack"]
    assert len(inner_packs) == len(array_leaves(inner_pullback))
    assert len(inner_packs) + len(outer_packs) == len(array_leaves(stored))


# What a pack hook sees, by what torch saves: a Python number is never hooked (torch keeps it
# in the node, not as a saved tensor); an array constant is. (jax function, torch function of
# torch and a, the shapes the pack hook sees.)
CONSTANTS = {
    "a * 3": (lambda a: a * 3, lambda torch, a: a * 3, []),
    "a / 2.0 + 1": (lambda a: a / 2.0 + 1, lambda torch, a: a / 2.0 + 1, []),
    "sin(a) * 3.5": (lambda a: jnp.sin(a) * 3.5, lambda torch, a: a.sin() * 3.5, [(2,)]),
    "a * array(3.0)": (lambda a: a * THREE, lambda torch, a: a * torch.tensor(3.0), [()]),
}
THREE = jnp.array(3.0, jnp.float32)


@pytest.mark.parametrize("jax_fn, shapes", [(f, shapes) for f, _, shapes in CONSTANTS.values()],
                         ids=CONSTANTS)
def test_python_numbers_are_not_hooked(variant, jax_fn, shapes):
    seen = []
    hooked = saved_tensors_hooks(lambda x: seen.append(x.shape) or x, lambda x: x)(
        lambda a: jnp.sum(jax_fn(a)))
    grad = variant(jax.grad(hooked))(jnp.ones(2))
    assert seen == shapes
    np.testing.assert_allclose(grad, jax.grad(lambda a: jnp.sum(jax_fn(a)))(jnp.ones(2)))


def test_torch_hooks_no_python_number(torch):
    seen: list = []
    for _, torch_fn, shapes in CONSTANTS.values():
        seen.clear()
        a = torch.ones(2, requires_grad=True)
        with torch.autograd.graph.saved_tensors_hooks(
                lambda x: seen.append(tuple(x.shape)) or x, lambda x: x):
            torch_fn(torch, a).sum().backward()
        assert seen == shapes


def test_a_function_that_needs_concrete_values_runs_eagerly_with_its_numbers_hooked():
    # Python control flow on a value: the function cannot be traced to find its literals, so it
    # runs eagerly as JAX's vjp runs it, and the 3.0 it keeps reaches the pack hook.
    seen = []
    hooked = saved_tensors_hooks(lambda x: seen.append(x.shape) or x, lambda x: x)(
        lambda a: jnp.sum(a * 3) if a[0] > 0 else jnp.sum(a))
    np.testing.assert_array_equal(jax.grad(hooked)(jnp.ones(2)), [3.0, 3.0])
    assert seen == [()]


def test_hooks_are_not_a_context_manager():
    with pytest.raises(TypeError, match=r"Wrap the function"):
        with saved_tensors_hooks(lambda t: t, lambda t: t):
            pass


def test_hooks_must_be_callable():
    with pytest.raises(TypeError, match="unpack_hook"):
        saved_tensors_hooks(lambda t: t, None)


# -- disable_saved_tensors_hooks ----------------------------------------------------------------

def test_disable_raises_with_the_message(variant):
    message = "saved tensors default hooks are disabled"
    hooked = save_on_cpu()(lambda x: jnp.sum(jnp.sin(x)))
    grad = variant(jax.grad(hooked))
    with disable_saved_tensors_hooks(message):
        with pytest.raises(RuntimeError, match=message):
            grad(jnp.ones(3))
    np.testing.assert_allclose(grad(jnp.zeros(3)), jnp.ones(3))  # allowed again outside


def test_disable_as_a_decorator_and_with_the_context_form():
    message = "no hooks in this function"

    @disable_saved_tensors_hooks(message)
    def step(x):
        return jax.grad(save_as(jnp.bfloat16)(lambda x: jnp.sum(x ** 2)))(x)

    with pytest.raises(RuntimeError, match=message):
        step(jnp.ones(2))
    with disable_saved_tensors_hooks(message):  # the seed's example
        with pytest.raises(RuntimeError, match=message):
            with save_on_cpu():
                pass


def test_disable_nests_and_restores():
    hooked = saved_tensors_hooks(lambda t: t, lambda t: t)(jnp.sin)
    with disable_saved_tensors_hooks("outer"):
        with disable_saved_tensors_hooks("inner"):
            with pytest.raises(RuntimeError, match="inner"):
                hooked(jnp.ones(1))
        with pytest.raises(RuntimeError, match="outer"):
            hooked(jnp.ones(1))
    hooked(jnp.ones(1))


# -- save_as ------------------------------------------------------------------------------------

def test_bf16_residuals_grads_within_rounding(variant):
    params, x = make_params()
    hooked = save_as(jnp.bfloat16)(mlp)
    got = variant(jax.grad(hooked, argnums=(0, 1)))(params, x)
    want = jax.grad(mlp, argnums=(0, 1))(params, x)
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        assert g.dtype == w.dtype == jnp.float32
        np.testing.assert_allclose(g, w, rtol=3e-2, atol=3e-2 * float(jnp.max(jnp.abs(w))))
    assert any(not np.array_equal(g, w) for g, w in zip(jax.tree_util.tree_leaves(got),
                                                        jax.tree_util.tree_leaves(want)))


def test_bf16_residuals_are_stored_in_bf16():
    params, x = make_params()
    _, stored = jax.vjp(save_as(jnp.bfloat16)(mlp), params, x)
    _, plain = jax.vjp(mlp, params, x)
    assert {a.dtype for a in array_leaves(stored)} == {jnp.dtype(jnp.bfloat16)}
    nbytes = lambda tree: sum(a.nbytes for a in array_leaves(tree))  # noqa: E731
    assert nbytes(stored) == nbytes(plain) // 2


@pytest.mark.parametrize("dtype,rtol", [(jnp.float16, 2e-3), (jnp.float8_e4m3fn, 0.15)])
def test_narrow_range_dtypes_are_scaled_so_nothing_overflows(variant, dtype, rtol):
    f = lambda x: jnp.sum(jnp.sin(x) * x ** 2)  # noqa: E731
    x = jnp.linspace(-3000.0, 3000.0, 7)  # residuals up to ~1e7: past float16's and fp8's range
    got = variant(jax.grad(save_as(dtype)(f)))(x)
    want = jax.grad(f)(x)
    assert bool(jnp.all(jnp.isfinite(got)))
    np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * float(jnp.max(jnp.abs(want))))


def test_save_as_leaves_integer_and_narrow_residuals_alone():
    log = []
    inner = counting(log)(lambda x, idx: jnp.sum(x[idx] ** 2))
    x, idx = jnp.arange(4.0, dtype=jnp.bfloat16), jnp.array([1, 3])
    got = jax.grad(save_as(jnp.bfloat16)(lambda x: inner(x, idx)))(x)
    np.testing.assert_array_equal(got, jax.grad(lambda x: jnp.sum(x[idx] ** 2))(x))


def test_save_as_rejects_non_floating_dtypes():
    with pytest.raises(ValueError, match="floating dtype"):
        save_as(jnp.int8)
    with pytest.raises(ValueError, match="floating dtype"):
        save_as("not a dtype")


# -- with autocast ------------------------------------------------------------------------------

def test_autocast_inside_the_hooked_function(variant):
    params, x = make_params()
    auto = jamp.autocast(mlp, dtype=jnp.bfloat16)
    log = []
    got = variant(jax.grad(counting(log)(auto)))(params, x)
    want = variant(jax.grad(auto))(params, x)
    chex.assert_trees_all_equal(got, want)
    # the matmuls ran in bfloat16, so some of the residuals they saved are bfloat16
    assert jnp.dtype(jnp.bfloat16) in {dtype for event, _, dtype in log if event == "pack"}
    lossy = variant(jax.grad(save_as(jnp.bfloat16)(auto)))(params, x)
    for g, w in zip(lossy, want):
        np.testing.assert_allclose(g, w, rtol=5e-2, atol=5e-2 * float(jnp.max(jnp.abs(w))))


def test_autocast_outside_the_hooked_function(variant):
    params, x = make_params()
    log = []
    got = variant(jax.grad(jamp.autocast(counting(log)(mlp), dtype=jnp.bfloat16)))(params, x)
    want = variant(jax.grad(jamp.autocast(mlp, dtype=jnp.bfloat16)))(params, x)
    assert [e for e in log if e[0] == "pack"]
    for g, w in zip(got, want):
        assert g.dtype == jnp.float32
        np.testing.assert_allclose(g, w, rtol=2e-2, atol=2e-2 * float(jnp.max(jnp.abs(w))))


# -- save_on_cpu --------------------------------------------------------------------------------

def test_the_cpu_backend_exposes_host_memory_kinds():
    kinds = {m.kind for m in jax.devices()[0].addressable_memories()}
    assert {"device", "pinned_host"} <= kinds


@pytest.mark.parametrize("pin_memory", [False, True])
def test_save_on_cpu_grads_are_exact(variant, pin_memory):
    params, x = make_params()
    got = variant(jax.grad(save_on_cpu(pin_memory)(mlp), argnums=(0, 1)))(params, x)
    want = variant(jax.grad(mlp, argnums=(0, 1)))(params, x)
    chex.assert_trees_all_equal(got, want)


def test_save_on_cpu_stores_residuals_in_pinned_host_memory():
    params, x = make_params()
    hooked = save_on_cpu()(mlp)
    _, eager = jax.vjp(hooked, params, x)
    _, jitted = jax.jit(lambda p, x: jax.vjp(hooked, p, x))(params, x)
    for stored in (eager, jitted):
        kinds = {a.sharding.memory_kind for a in array_leaves(stored)}
        assert kinds == {"pinned_host"}
    # traced: the residuals are typed as host values between the forward and the backward
    closed = jax.make_jaxpr(lambda p, x: array_leaves(jax.vjp(hooked, p, x)[1]))(params, x)
    assert {aval.memory_space for aval in closed.out_avals} == {jax.memory.Space.Host}


def test_save_on_cpu_keeps_the_sharding_of_sharded_residuals():
    devices = np.array(jax.devices()[:8])
    if devices.size < 8:
        pytest.skip("needs the 8 host devices of tests/conftest.py")
    mesh = jax.sharding.Mesh(devices, ("data",))
    spec = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    params, _ = make_params()
    x = jax.device_put(jax.random.normal(jax.random.key(1), (16, 8)), spec)
    hooked = save_on_cpu()(mlp)
    _, stored = jax.jit(lambda p, x: jax.vjp(hooked, p, x))(params, x)
    batch = [a for a in array_leaves(stored) if a.shape[0] == 16]
    assert batch and all(a.sharding.memory_kind == "pinned_host" for a in batch)
    assert all(a.sharding.is_equivalent_to(spec.with_memory_kind("pinned_host"), a.ndim)
               for a in batch)
    got = jax.jit(jax.grad(hooked))(params, x)
    want = jax.jit(jax.grad(mlp))(params, x)
    chex.assert_trees_all_close(got, want, rtol=1e-7)


def test_save_on_cpu_checks_pin_memory():
    with pytest.raises(TypeError, match="pin_memory"):
        save_on_cpu(pin_memory="yes")


# -- the seed's example -------------------------------------------------------------------------

EXPECTED = """\
Packing [1. 1. 1. 1. 1.]
Packing [2. 2. 2. 2. 2.]
Unpacking [1. 1. 1. 1. 1.]
Unpacking [2. 2. 2. 2. 2.]
"""


def test_seed_example_with_python_print_eagerly(capsys):
    def pack_hook(x):
        print("Packing", x)
        return x

    def unpack_hook(x):
        print("Unpacking", x)
        return x

    a = jnp.ones(5)
    b = jnp.ones(5) * 2
    mul = saved_tensors_hooks(pack_hook, unpack_hook)(lambda a, b: a * b)
    jax.grad(lambda a, b: mul(a, b).sum(), argnums=(0, 1))(a, b)
    assert capsys.readouterr().out == EXPECTED


def test_seed_example_with_debug_print_under_jit(capsys):
    def pack_hook(x):
        jax.debug.print("Packing {}", x, ordered=True)
        return x

    def unpack_hook(x):
        jax.debug.print("Unpacking {}", x, ordered=True)
        return x

    mul = saved_tensors_hooks(pack_hook, unpack_hook)(lambda a, b: a * b)
    step = jax.jit(jax.grad(lambda a, b: mul(a, b).sum(), argnums=(0, 1)))
    a = jnp.ones(5)
    b = jnp.ones(5) * 2
    for _ in range(2):  # printed on every run of the compiled step, not once at trace time
        jax.block_until_ready(step(a, b))
        jax.effects_barrier()
        assert capsys.readouterr().out == EXPECTED
