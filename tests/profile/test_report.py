"""jamp.profile.amp_report: FLOPs, bytes and converts read from the program, checked against
the shapes, the jaxpr and the lowered StableHLO of known programs."""

import json
import re
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

import jamp
from helpers import lowered_op_types, needs_examples_extra
from jamp.profile.report import AmpReport, amp_report

B, D_IN, D_HID, D_OUT = 8, 16, 32, 4
W1 = jnp.full((D_IN, D_HID), 0.1)
W2 = jnp.full((D_HID, D_OUT), 0.1)
X = jnp.ones((B, D_IN))
MLP_FLOPS = 2 * B * D_IN * D_HID + 2 * B * D_HID * D_OUT


def mlp(w1, w2, x):
    return jnp.mean(jnp.tanh(x @ w1) @ w2)


def lowered_converts(fn, *args, **kwargs) -> int:
    """`stablehlo.convert` ops in the lowered program, counted in its text."""
    text = jax.jit(fn).lower(*args, **kwargs).as_text()
    return len(re.findall(r"\bstablehlo\.convert\b", text))


def static_converts(report: AmpReport) -> int:
    return sum(c.static_count for c in report.converts)


def row(rows, name):
    return next(r for r in rows if r.name == name)


# -- half_flops_fraction and FLOPs ------------------------------------------------------------

def test_a_float32_mlp_runs_no_flops_in_half_precision():
    report = amp_report(mlp, W1, W2, X)
    assert report.half_flops_fraction == 0.0
    assert report.flops == {"float32": MLP_FLOPS}
    assert report.converts == ()
    dots = row(report.primitives, "dot_general")
    assert (dots.static_count, dots.count, dots.flops) == (2, 2, {"float32": MLP_FLOPS})


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_an_autocast_mlp_runs_its_matmul_flops_in_half_precision(dtype):
    fn = jamp.autocast(mlp, dtype=dtype)
    report = amp_report(fn, W1, W2, X)
    assert report.half_flops_fraction >= 0.9
    name = jnp.dtype(dtype).name
    assert report.flops == {name: MLP_FLOPS}
    # The dtype the report names is the one the lowered program's matmuls take.
    assert {types[:2] for types in lowered_op_types(fn, W1, W2, X, op="dot_general")} == {
        (name, name)}
    assert static_converts(report) == lowered_converts(fn, W1, W2, X) > 0


def test_matmul_flops_are_counted_in_the_operand_dtype_not_the_result_dtype():
    def f(a, b):  # batched: 2 * batch * m * n * k
        return lax.dot_general(a, b, (((2,), (1,)), ((0,), (0,))),
                               preferred_element_type=jnp.float32)

    a, b = jnp.ones((3, 5, 7), jnp.bfloat16), jnp.ones((3, 7, 2), jnp.bfloat16)
    report = amp_report(f, a, b)
    assert report.flops == {"bfloat16": 2 * 3 * 5 * 2 * 7}
    assert report.half_flops_fraction == 1.0


def test_convolution_flops_count_one_group_of_input_features():
    def conv(x, k):
        return lax.conv_general_dilated(x, k, (1, 1), "SAME", feature_group_count=2)

    x, k = jnp.ones((2, 4, 8, 8), jnp.float16), jnp.ones((6, 2, 3, 3), jnp.float16)
    report = amp_report(conv, x, k)
    # Output 2x6x8x8, a 3x3 window over 4 / 2 input features per group.
    assert report.flops == {"float16": 2 * (2 * 6 * 8 * 8) * (3 * 3) * 2}
    assert lowered_op_types(conv, x, k, op="convolution") == [("float16",) * 3]


def test_a_region_with_autocast_off_runs_its_matmul_in_float32():
    def f(w1, w2, x):
        h = jnp.tanh(x @ w1)
        with jamp.autocast(enabled=False):
            return h @ w2

    report = amp_report(jamp.autocast(f, dtype=jnp.bfloat16), W1, W2, X)
    half, full = 2 * B * D_IN * D_HID, 2 * B * D_HID * D_OUT
    assert report.flops == {"bfloat16": half, "float32": full}
    assert report.half_flops_fraction == half / (half + full)
    # autocast's region markers are not modules.
    assert [m.name for m in report.modules] == ["(top level)"]


# -- sub-programs -----------------------------------------------------------------------------

def test_a_scan_body_runs_length_times():
    def f(w, x):
        return lax.scan(lambda h, _: (jnp.tanh(h @ w), None), x, None, length=5)[0]

    w, x = jnp.ones((D_IN, D_IN)), jnp.ones((B, D_IN))
    report = amp_report(f, w, x)
    dots, tanh = row(report.primitives, "dot_general"), row(report.primitives, "tanh")
    assert (dots.static_count, dots.count) == (1, 5)
    assert dots.flops == {"float32": 5 * 2 * B * D_IN * D_IN}
    assert tanh.bytes == {"float32": 5 * 2 * B * D_IN * 4}  # in and out, 4 bytes each


def test_a_cond_counts_every_branch_once_and_runs_the_costliest():
    def f(x):
        return lax.cond(x[0, 0] > 0, lambda: x @ x @ x, lambda: x @ x)

    x = jnp.ones((4, 4))
    dots = row(amp_report(f, x).primitives, "dot_general")
    assert (dots.static_count, dots.count, dots.flops) == (3, 2, {"float32": 2 * 2 * 4 ** 3})


def test_a_while_body_is_counted_once():
    def f(x):
        return lax.while_loop(lambda c: c[0, 0] < 100.0, lambda c: c @ c, x)

    dots = row(amp_report(f, jnp.ones((4, 4))).primitives, "dot_general")
    assert (dots.static_count, dots.count) == (1, 1)


def test_a_jit_called_twice_is_one_function_of_the_lowered_program_and_runs_twice():
    @jax.jit
    def inner(x):
        return (x.astype(jnp.bfloat16) * 2).astype(jnp.float32)

    def f(x):
        return inner(x) + inner(x + 1)

    x = jnp.ones(8)
    report = amp_report(f, x)
    assert [(c.source, c.target, c.static_count, c.count, c.bytes) for c in report.converts] == [
        ("bfloat16", "float32", 1, 2, 2 * 8 * 4), ("float32", "bfloat16", 1, 2, 2 * 8 * 2)]
    assert static_converts(report) == lowered_converts(f, x) == 2


def test_a_shard_map_body_runs_on_every_device():
    mesh = jax.make_mesh((4,), ("d",), devices=jax.devices()[:4])
    x = jax.device_put(jnp.ones((8, D_IN)), NamedSharding(mesh, P("d")))
    w = jax.device_put(jnp.ones((D_IN, D_OUT)), NamedSharding(mesh, P()))

    def f(x, w):
        return jax.shard_map(lambda a, b: lax.psum(a @ b, "d"), mesh=mesh,
                             in_specs=(P("d"), P()), out_specs=P())(x, w)

    dots = row(amp_report(f, x, w).primitives, "dot_general")
    # Each device multiplies its 2 rows: together, the 8 rows of the whole matmul.
    assert (dots.static_count, dots.count, dots.flops) == (1, 4, {"float32": 2 * 8 * D_IN * D_OUT})


def test_custom_derivative_and_checkpoint_bodies_are_counted_forward_and_backward():
    @jax.custom_vjp
    def scaled(x):
        return 2 * x

    scaled.defvjp(lambda x: (2 * x, None), lambda _, g: (2 * g,))

    def f(w1, w2, x):
        h = jax.checkpoint(lambda x: jax.nn.relu(x @ w1))(x)  # relu is a custom_jvp
        return jnp.sum(scaled(h) @ w2)

    fn = jax.grad(jamp.autocast(f, dtype=jnp.bfloat16), argnums=(0, 1))
    report = amp_report(fn, W1, W2, X)
    # x @ w1, again where the checkpoint recomputes it, and w1's grad; the grads of w2 and of
    # h. The forward h @ w2 is dead code (the grads need no value of it), as is x's grad.
    dots = row(report.primitives, "dot_general")
    assert dots.static_count == len(lowered_op_types(fn, W1, W2, X, op="dot_general")) == 5
    assert dots.flops == {"bfloat16": 3 * 2 * B * D_IN * D_HID + 2 * 2 * B * D_HID * D_OUT}
    assert report.half_flops_fraction == 1.0
    assert static_converts(report) == lowered_converts(fn, W1, W2, X)


def test_flax_nnx_calls_are_modules_by_graph_path_under_autocast():
    from flax import nnx

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.hidden, self.out = nnx.Linear(D_IN, D_HID, rngs=rngs), nnx.Linear(D_HID, D_OUT,
                                                                                   rngs=rngs)

        def __call__(self, x):
            h = jax.nn.relu(self.hidden(x))
            with jax.named_scope("out"):
                return self.out(h)

    report = amp_report(jamp.autocast(lambda net, x: net(x).sum(), dtype=jnp.bfloat16),
                        Net(nnx.Rngs(0)), X)
    # autocast names each NNX call by its graph path (the `out` scope around `self.out` is the
    # same module, named twice in a row).
    modules = {m.name: m.flops for m in report.modules if m.flops}
    assert modules == {"Net/out": {"bfloat16": 2 * B * D_HID * D_OUT},
                       "Net/hidden": {"bfloat16": 2 * B * D_IN * D_HID}}


def test_dead_code_is_left_out_as_jax_jit_leaves_it_out():
    def f(x):
        x.astype(jnp.bfloat16) @ x.astype(jnp.bfloat16).T  # unused
        return x * 2

    report = amp_report(f, X)
    assert report.flops == {} and report.converts == ()
    assert row(report.primitives, "mul").count == 1
    assert lowered_converts(f, X) == 0


# -- Flax modules and the converts of real programs ---------------------------------------------

class Attention(nn.Module):
    @nn.compact
    def __call__(self, x):
        q, k = nn.Dense(D_HID, name="query")(x), nn.Dense(D_HID, name="key")(x)
        weights = jax.nn.softmax(q @ k.swapaxes(-1, -2) / jnp.sqrt(D_HID))
        return weights @ x


class Model(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = x + Attention()(nn.LayerNorm()(x))
        hidden = nn.relu(nn.Dense(D_HID)(x))
        return nn.Dense(D_OUT)(hidden)


T = 6
MODEL = Model()
TOKENS = jax.random.normal(jax.random.key(1), (B, T, D_IN))
LABELS = jnp.arange(B * T).reshape(B, T) % D_OUT
PARAMS = MODEL.init(jax.random.key(0), TOKENS)["params"]


def loss_fn(params, x, y):
    logits = MODEL.apply({"params": params}, x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def test_flax_linen_modules_are_rows_with_their_paths_and_flops():
    report = amp_report(jamp.autocast(loss_fn, dtype=jnp.bfloat16), PARAMS, TOKENS, LABELS)
    modules = {m.name: m for m in report.modules}
    assert set(modules) == {"Model", "Model/LayerNorm_0", "Model/Attention_0",
                            "Model/Attention_0/query", "Model/Attention_0/key", "Model/Dense_0",
                            "Model/Dense_1", "(top level)"}
    dense = lambda d_in, d_out: {"bfloat16": 2 * B * T * d_in * d_out}
    assert modules["Model/Attention_0/query"].flops == dense(D_IN, D_HID)
    assert modules["Model/Dense_0"].flops == dense(D_IN, D_HID)
    assert modules["Model/Dense_1"].flops == dense(D_HID, D_OUT)
    # The attention's own matmuls: scores (T x T over D_HID) and weights @ x (T x D_IN over T).
    assert modules["Model/Attention_0"].flops == {
        "bfloat16": 2 * B * T * T * D_HID + 2 * B * T * D_IN * T}
    assert not modules["Model/LayerNorm_0"].flops  # statistics in float32, no matmul
    assert set(modules["Model/LayerNorm_0"].bytes) == {"float32"}
    assert report.half_flops_fraction >= 0.9


def test_a_module_calling_its_parent_class_call_is_one_module():
    class Doubled(nn.Dense):  # Flax names the call to nn.Dense.__call__ again: Doubled_0
        def __call__(self, x):
            return super().__call__(x) * 2

    class Outer(nn.Module):
        @nn.compact
        def __call__(self, x):
            return Doubled(D_OUT)(x)

    model = Outer()
    params = model.init(jax.random.key(0), X)
    report = amp_report(model.apply, params, X)
    assert [(m.name, m.flops) for m in report.modules] == [
        ("Outer/Doubled_0", {"float32": 2 * B * D_IN * D_OUT})]


def test_an_einsum_is_an_op_of_its_module_not_a_module():
    class Mixer(nn.Module):  # jnp.einsum opens a scope named by its subscripts
        @nn.compact
        def __call__(self, x):
            w = self.param("w", nn.initializers.ones, (D_IN, D_OUT))
            return jnp.einsum("bi,io->bo", x, w)

    model = Mixer()
    params = model.init(jax.random.key(0), X)
    report = amp_report(model.apply, params, X)
    assert [(m.name, m.flops) for m in report.modules] == [
        ("Mixer", {"float32": 2 * B * D_IN * D_OUT})]


def adamw_step(params, opt_state, x, y, tx):
    grads = jax.grad(jamp.autocast(loss_fn, device_type="cuda"))(params, x, y)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state


@pytest.mark.parametrize("program", ["autocast mlp", "float32 mlp", "autocast flax", "grad step"])
def test_the_converts_are_those_of_the_lowered_program(program):
    tx = optax.adamw(1e-3)
    fn, args = {
        "autocast mlp": (jamp.autocast(mlp, dtype=jnp.bfloat16), (W1, W2, X)),
        "float32 mlp": (mlp, (W1, W2, X)),
        "autocast flax": (jamp.autocast(loss_fn, dtype=jnp.bfloat16), (PARAMS, TOKENS, LABELS)),
        "grad step": (lambda p, s, x, y: adamw_step(p, s, x, y, tx),
                      (PARAMS, tx.init(PARAMS), TOKENS, LABELS)),
    }[program]
    report = amp_report(fn, *args)
    assert static_converts(report) == lowered_converts(fn, *args)
    assert report.compiled.lowered_converts == lowered_converts(fn, *args)
    by = {c.primitive for c in report.converts}
    if program == "autocast flax":
        # optax's cross entropy takes the label's log-probability with a gather that fills
        # out-of-bounds reads: its lowering converts the (int32) index on its own.
        assert ("int32", "int32", "gather") in {(c.source, c.target, c.primitive)
                                                for c in report.converts}
    if program == "grad step":
        # adamw's bias correction raises to an integer power: `pow` converts the exponent.
        assert ("int32", "float32", "pow") in {(c.source, c.target, c.primitive)
                                               for c in report.converts}
        assert report.half_flops_fraction >= 0.9
    if program == "float32 mlp":
        assert by == set()


def test_a_jitted_function_keyword_arguments_and_shapes_give_the_same_report():
    def f(w1, w2, *, x):
        return mlp(w1, w2, x)

    plain = amp_report(f, W1, W2, x=X)
    jitted = amp_report(jax.jit(f), W1, W2, x=X)
    shapes = amp_report(f, *(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (W1, W2)),
                        x=jax.ShapeDtypeStruct(X.shape, X.dtype))
    assert plain.to_dict() == jitted.to_dict() == shapes.to_dict()
    assert plain.flops == {"float32": MLP_FLOPS}


# -- the report's forms ---------------------------------------------------------------------

def test_to_dict_is_plain_json():
    report = amp_report(jamp.autocast(loss_fn, dtype=jnp.bfloat16), PARAMS, TOKENS, LABELS)
    d = report.to_dict()
    assert json.loads(json.dumps(d)) == d
    assert d["half_flops_fraction"] == report.half_flops_fraction
    assert {m["name"] for m in d["modules"]} == {m.name for m in report.modules}
    assert d["converts"][0].keys() == {"source", "target", "primitive", "static_count", "count",
                                       "bytes"}
    assert d["compiled"]["flops"] > 0 and d["compiled"]["memory"]["temp"] >= 0


def test_the_table_lists_primitives_modules_and_converts():
    report = amp_report(jamp.autocast(loss_fn, dtype=jnp.bfloat16), PARAMS, TOKENS, LABELS)
    text = report.table(row_limit=-1)
    assert text == str(report.table(row_limit=None))
    assert text.startswith("half_flops_fraction 1.000")
    for name in ("dot_general", "convert_element_type", "Model/Attention_0/query",
                 "Model/LayerNorm_0", "(top level)"):
        assert re.search(rf"^{re.escape(name)}\s+\d+\s+\d+", text, re.M), name
    assert re.search(r"^f32 -> bf16\s+\d+\s+\d+\s+.*convert_element_type$", text, re.M)
    short = report.table(row_limit=2)
    hidden = len(report.primitives) - 2
    assert f"... {hidden} more (row_limit)" in short and "(top level)" not in short
    assert str(report) == report.table()


@needs_examples_extra("matplotlib")
def test_plot_draws_a_bar_per_module_and_dtype():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def f(w1, w2, x):
        with jax.named_scope("first"):
            h = jnp.tanh(x @ w1)
        with jax.named_scope("second"), jamp.autocast(enabled=False):
            return h @ w2

    report = amp_report(jamp.autocast(f, dtype=jnp.bfloat16), W1, W2, X)
    ax = report.plot()
    assert [t.get_text() for t in ax.get_yticklabels()] == ["second", "first"]
    assert sorted(t.get_text() for t in ax.get_legend().get_texts()) == ["bfloat16", "float32"]
    assert sorted(p.get_width() for p in ax.patches if p.get_width()) == sorted(
        [2 * B * D_IN * D_HID, 2 * B * D_HID * D_OUT])
    plt.close(ax.figure)


def test_plot_without_matplotlib_says_what_to_install(monkeypatch):
    report = amp_report(mlp, W1, W2, X)
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)
    with pytest.raises(ImportError, match="pip install matplotlib"):
        report.plot()


def test_bad_input_is_named():
    with pytest.raises(TypeError, match=r"got 3 of type int"):
        amp_report(3, X)
    report = amp_report(mlp, W1, W2, X)
    with pytest.raises(TypeError, match=r"row_limit must be an int or None; got '5'"):
        report.table(row_limit="5")
    with pytest.raises(ValueError, match=r"got 'time'"):
        report.plot(quantity="time")


def test_weak_type_converts_are_counted_as_the_lowered_program_has_them():
    # Flax's attention scales by sqrt(depth): a weak float32 scalar made strong, which lowers
    # to a float32 -> float32 stablehlo.convert.
    class Attention(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.MultiHeadDotProductAttention(num_heads=2)(x)

    model = Attention()
    x = jnp.ones((2, 4, 8))
    params = model.init(jax.random.key(0), x)
    loss = jax.grad(lambda p, x: model.apply(p, x).sum())
    report = amp_report(loss, params, x)
    lowered = jax.jit(loss).lower(params, x).as_text().count("stablehlo.convert")
    assert lowered >= 1
    assert sum(c.static_count for c in report.converts) == lowered
    assert report.compiled.lowered_converts == lowered
    assert ("float32", "float32") in {(c.source, c.target) for c in report.converts}


def test_a_non_array_argument_is_refused_with_what_to_do():
    def scaled(w, x, how):
        return x @ w

    with pytest.raises(TypeError, match="functools.partial"):
        amp_report(scaled, jnp.ones((2, 2)), jnp.ones((2, 2)), how="relu")


def test_row_limit_zero_hides_rows_without_saying_none():
    text = amp_report(lambda w, x: x @ w, jnp.ones((2, 2)), jnp.ones((2, 2))).table(row_limit=0)
    primitives = text.split("\n\n")[1].splitlines()
    assert primitives[1:] == ["... 1 more (row_limit)"]


@needs_examples_extra("matplotlib")
def test_plot_of_bytes_puts_the_most_bytes_on_top():
    import matplotlib
    matplotlib.use("Agg")

    class Wide(nn.Module):  # few FLOPs, many bytes in one module; many FLOPs in the other
        @nn.compact
        def __call__(self, x):
            y = nn.Dense(64, name="flops")(x)
            with jax.named_scope("bytes"):
                z = jnp.tile(x, (1, 64)) * 2.0
            return y.sum() + z.sum()

    model = Wide()
    params = model.init(jax.random.key(0), X)
    report = amp_report(model.apply, params, X)
    ax = report.plot(quantity="bytes")
    labels = [t.get_text() for t in ax.get_yticklabels()]
    by_bytes = sorted(report.modules, key=lambda r: sum(r.bytes.values()))
    assert labels == [r.name for r in by_bytes if r.bytes]
