"""Precision rules (`jamp.autocast(fn, rules=...)`): per module path, named scope, NNX module and
Python function, first match first, regions nesting inside; Apex's "keep BatchNorm in float32"
and "force a layer to a type" as data. Dtypes are read per module from the transformed program,
values held against float32."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax import lax

import jamp
from jamp.policy import FP32, autocast_table
from jamp.policy.dtypes import is_floating
from jamp.transforms.nnx_scopes import named_calls
from jamp.transforms.rules import Rule, equation_path, module_pattern, rule_set

from helpers import BF16, F16, F32, compiles_during, rel_err


def ops(fn, *args, **kwargs):
    """(module path, primitive, input dtypes, output dtypes) of every floating first-order
    equation of the program `fn` traces to, in sub-jaxprs too, each path as precision rules see
    it."""
    found = []

    def walk(jaxpr, outer):
        for eqn in jaxpr.eqns:
            path = equation_path(eqn, outer)
            subs = list(jax.extend.core.jaxprs_in_params(eqn.params))
            for sub in subs:
                walk(getattr(sub, "jaxpr", sub), path)
            if subs:
                continue
            ins = tuple(np.dtype(v.aval.dtype) for v in eqn.invars if is_floating(v.aval))
            outs = tuple(np.dtype(v.aval.dtype) for v in eqn.outvars if is_floating(v.aval))
            if ins or outs:
                found.append(("/".join(path), eqn.primitive.name, ins, outs))

    walk(jax.make_jaxpr(fn)(*args, **kwargs).jaxpr, ())
    return found


def dtypes_of(found, primitive, inside=None, outside=None):
    """The input dtypes of the `primitive` equations in (or out of) a module path."""
    return [ins for path, name, ins, _ in found if name == primitive
            and (inside is None or inside in path) and (outside is None or outside not in path)]


class Net(nn.Module):
    """Dense -> BatchNorm -> relu -> Dense."""

    @nn.compact
    def __call__(self, x, train=False):
        x = nn.BatchNorm(use_running_average=not train)(nn.Dense(8)(x))
        return nn.Dense(4)(nn.relu(x))


@pytest.fixture(scope="module")
def net():
    model, x = Net(), jax.random.normal(jax.random.key(0), (6, 5))
    return model, jax.jit(model.init)(jax.random.key(1), x), x


# -- Apex's rows as data ----------------------------------------------------------------------

@pytest.mark.parametrize("pattern", ["BatchNorm_*", "flax.linen.BatchNorm"])
def test_keep_batchnorm_in_float32(net, pattern, variant):
    model, variables, x = net
    plain = jamp.autocast(model.apply, device_type="cpu", cast_outputs=False)
    kept = jamp.autocast(model.apply, device_type="cpu", cast_outputs=False,
                         rules=[(pattern, jnp.float32)])
    # Without the rule the cpu table's BatchNorm returns its activation's bfloat16 (to the
    # relu after it); with it, everything BatchNorm computes and returns is float32, and the
    # Dense layers still lower.
    relu = lambda found: [ins[0] for path, name, ins, _ in found
                          if name == "max" and path == "Net"]
    assert relu(ops(plain, variables, x)) == [BF16]
    found = ops(kept, variables, x)
    assert relu(found) == [F32]
    # (BatchNorm reads the Dense layer's bfloat16 result and casts it: the layer before it
    # keeps its own dtype.)
    assert {d for path, name, ins, _ in found if "BatchNorm_0" in path
            and name != "convert_element_type" for d in ins} == {F32}
    assert dtypes_of(found, "dot_general") == [(BF16, BF16)] * 2
    # Training: the running statistics, updated in float32, match float32's.
    step = variant(lambda v, x: kept(v, x, train=True, mutable=["batch_stats"]))
    out, stats = step(variables, x)
    want, want_stats = model.apply(variables, x, train=True, mutable=["batch_stats"])
    assert rel_err(out, want) < 2e-2
    assert rel_err(stats["batch_stats"]["BatchNorm_0"]["var"],
                   want_stats["batch_stats"]["BatchNorm_0"]["var"]) < 1e-2


def test_force_a_dense_layer_to_float32(net, variant):
    model, variables, x = net
    apply = jamp.autocast(model.apply, device_type="cuda", cast_outputs=False,
                          rules=[("Dense_1", "float32")])
    found = ops(apply, variables, x)
    # Dense_1 reads the float16 activations before it in float32 and computes in float32.
    assert dtypes_of(found, "dot_general", inside="Dense_1") == [(F32, F32)]
    assert dtypes_of(found, "dot_general", outside="Dense_1") == [(F16, F16)]
    out = variant(apply)(variables, x)
    assert out.dtype == F32 and rel_err(out, model.apply(variables, x)) < 2e-2


# -- patterns, order, settings, regions -------------------------------------------------------

W = jnp.linspace(-0.5, 0.5, 16, dtype=jnp.float32).reshape(4, 4)
X = jnp.linspace(-1.0, 1.0, 12, dtype=jnp.float32).reshape(3, 4)


def softmax(h):
    """Written out, so that its exp follows the op table (jax.nn.softmax is one kernel on the
    cpu table, float32 inside)."""
    e = jnp.exp(h - jnp.max(h, axis=-1, keepdims=True))
    return e / jnp.sum(e, axis=-1, keepdims=True)


def encoder(x, w):
    """A named scope `encoder` holding `inner` and an autocast region, then work outside."""
    with jax.named_scope("encoder"):
        h = softmax(x @ w)
        with jax.named_scope("inner"):
            h = h @ w
        with jamp.autocast(dtype=jnp.float16):  # a region inside a matched module nests
            h = h @ w
    return softmax(h @ w)


def test_regions_nest_inside_a_ruled_module_and_yield_around_it():
    def f(x, w):
        h = encoder(x, w)
        with jamp.autocast(enabled=False):  # a region around a matched module is overridden
            with jax.named_scope("head"):
                return h @ w

    found = ops(jamp.autocast(f, device_type="cpu", cast_outputs=False,
                              rules=[("encoder", jnp.float32), ("head", jnp.bfloat16)]), X, W)
    assert dtypes_of(found, "dot_general") == [(F32, F32), (F32, F32), (F16, F16), (BF16, BF16),
                                               (BF16, BF16)]


@pytest.mark.parametrize("rules,dots,exps", [
    # First match wins: "on" carves the transform's own setting out of a wider rule.
    ([("encoder/inner", "on"), ("encoder", "off")], [F32, BF16, F16, BF16], [F32, BF16]),
    # Op rules changed in the table that applies, and a whole table.
    ([("encoder", {"exp": FP32})], [BF16, BF16, F16, BF16], [F32, BF16]),
    ([("encoder", autocast_table("cuda"))], [BF16, BF16, F16, BF16], [F32, BF16]),
    # Globs, anchored at the top, and everything.
    ([("*er", jnp.float32)], [F32, F32, F16, BF16], [F32, BF16]),
    ([("/top/encoder/inner", "off")], [BF16, F32, F16, BF16], [BF16, BF16]),
    ([("**", "off")], [F32, F32, F16, F32], [F32, F32]),
])
def test_first_match_wins_and_settings(rules, dots, exps):
    def top(x, w):
        with jax.named_scope("top"):
            return encoder(x, w)

    found = ops(jamp.autocast(top, device_type="cpu", cast_outputs=False, rules=rules), X, W)
    assert [ins[0] for ins in dtypes_of(found, "dot_general")] == dots
    assert [ins[0] for ins in dtypes_of(found, "exp")] == exps


def test_module_pattern_names_exactly_one_module(net):
    model, variables, x = net
    apply = jamp.autocast(model.apply, device_type="cpu", cast_outputs=False)
    paths = sorted({tuple(p.split("/")) for p, *_ in ops(apply, variables, x) if p})
    assert paths == [("Net",), ("Net", "BatchNorm_0"), ("Net", "Dense_0"), ("Net", "Dense_1")]
    for path in paths[1:]:  # each module alone, by the pattern the debugger proposes
        ruled = jamp.autocast(model.apply, device_type="cpu", cast_outputs=False,
                              rules=[(module_pattern(path), "off")])
        for where, name, ins, _ in ops(ruled, variables, x):
            if name == "dot_general":
                assert (ins[0] == F32) == where.startswith("/".join(path))
    # Glob characters in a module's name are matched literally.
    rule = Rule.of(module_pattern(("Net", "a*b[0]")), "off")
    assert rule.depth(("Net", "a*b[0]", "Dense_0")) == 2
    assert rule.depth(("Net", "axb0")) is None and rule.depth(("Top", "Net", "a*b[0]")) is None


def test_rules_key_the_program_cache():
    def f(x, w):
        with jax.named_scope("m"):
            return x @ w

    first = jamp.autocast(f, device_type="cpu", cast_outputs=False, rules=[("m", jnp.float32)])
    assert first(X, W).dtype == F32 and first(X, W).dtype == F32
    again = jamp.autocast(f, device_type="cpu", cast_outputs=False, rules=[("m", "float32")])
    assert compiles_during(lambda: again(X, W)) == 0  # the same rules: the cached program
    assert again(X, W).dtype == F32
    other = jamp.autocast(f, device_type="cpu", cast_outputs=False, rules=[("m", "bfloat16")])
    assert compiles_during(lambda: other(X, W)) > 0
    assert other(X, W).dtype == BF16


def test_rules_inside_scan_remat_jit_vmap_and_grad():
    def f(x, w):
        def body(c, _):
            with jax.named_scope("cell"):
                return jnp.tanh(c @ w), None
        c, _ = lax.scan(jax.checkpoint(body), x, None, length=2)
        out = jax.jit(jax.vmap(lambda r: r @ w))(c)
        return jnp.mean(jax.nn.softmax(out) ** 2)

    rules = [("cell", jnp.float32), ("jax.nn.softmax", "off")]
    auto = jamp.autocast(f, device_type="cuda", rules=rules)
    # Differentiated from outside: the cell's backward matmuls run in float32 too.
    found = ops(jax.grad(auto, argnums=1), X, W)
    assert set(dtypes_of(found, "dot_general", inside="cell")) == {(F32, F32)}
    assert set(dtypes_of(found, "dot_general", outside="cell")) == {(F16, F16)}
    assert set(dtypes_of(found, "exp")) == {(F32,)}
    grad = jax.jit(jax.grad(auto, argnums=1))(X, W)
    assert rel_err(grad, jax.grad(f, argnums=1)(X, W)) < 2e-2


def test_table_function_rules_come_after_the_users():
    table = dataclasses.replace(autocast_table("cpu"),
                                functions=(("jax.nn.softmax", "float32"),))
    f = lambda x, w: jax.nn.softmax(x @ w) @ w
    by_table = ops(jamp.autocast(f, op_table=table, cast_outputs=False), X, W)
    assert dtypes_of(by_table, "exp") == [(F32,)]
    mine = ops(jamp.autocast(f, op_table=table, cast_outputs=False,
                             rules=[("jax.nn.softmax", jnp.bfloat16)]), X, W)
    assert dtypes_of(mine, "exp") == [(BF16,)]


# -- errors -----------------------------------------------------------------------------------

@pytest.mark.parametrize("rules,error,match", [
    ([("BatchNorm_1", jnp.float32)], ValueError,
     r"'BatchNorm_1' matched nothing.*Closest module paths traced: 'BatchNorm_0'"),
    ([("Net", jnp.float32), ("Dense_0", "off")], ValueError,
     r"'Dense_0' decides nothing.*matched first by the earlier rule 'Net'"),
    ([("optax.ctc_loss", "off")], ValueError, r"no equation was traced inside that function"),
    ([("Dense_0", "int8")], ValueError,
     r"sets 'int8': expected a dtype autocast can use \(float16, bfloat16, float32\), 'off'"),
    ([("Dense_0", {"softmax": FP32})], ValueError, r"'softmax', which is not a JAX primitive"),
    ([("Net//Dense_0", "off")], ValueError, r"pattern 'Net//Dense_0' has an empty segment"),
    ([("Net/x**", "off")], ValueError, r"'\*\*' stands for whole segments only"),
    (["Dense_0"], TypeError, r"\(pattern, setting\) pair .* got 'Dense_0'"),
    ([(3, "off")], TypeError, r"the pattern must be a string"),
    ("Dense_0", TypeError, r"rules= takes a list of \(pattern, setting\) pairs"),
])
def test_bad_rules_are_refused_by_name(net, rules, error, match):
    model, variables, x = net
    with pytest.raises(error, match=match):
        jamp.autocast(model.apply, device_type="cpu", rules=rules)(variables, x)


def test_a_region_refuses_rules():
    with pytest.raises(ValueError, match="rules apply to a transform"):
        with jamp.autocast(rules=[("m", "off")]):
            pass


# -- NNX --------------------------------------------------------------------------------------

class Cell(nnx.Module):
    def __init__(self, rngs):
        self.linear = nnx.Linear(4, 4, rngs=rngs)
        self.bn = nnx.BatchNorm(4, rngs=rngs)

    def __call__(self, x):
        return jax.nn.relu(self.bn(self.linear(x)))


class Tower(nnx.Module):
    def __init__(self, rngs):
        self.blocks = nnx.List([Cell(rngs), Cell(rngs)])
        self.head = nnx.Linear(4, 2, rngs=rngs)

    def __call__(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def test_nnx_modules_are_named_by_graph_path():
    model = Tower(nnx.Rngs(0))
    model.eval()
    with named_calls([model]):
        found = ops(model, X)
    assert {p for p, *_ in found} == {"Tower/blocks/0/linear", "Tower/blocks/0/bn",
                                      "Tower/blocks/0", "Tower/blocks/1/linear",
                                      "Tower/blocks/1/bn", "Tower/blocks/1", "Tower/head"}
    assert type(model.head).__call__ is nnx.Linear.__call__  # the classes are left as they were
    found = ops(jamp.autocast(lambda x: model(x), device_type="cpu", cast_outputs=False,
                              rules=[("blocks/1", jnp.float32)]), X)
    assert dtypes_of(found, "dot_general") == [(BF16, BF16), (F32, F32), (BF16, BF16)]


# -- real models under jit --------------------------------------------------------------------

class PaddedEncoder(nn.Module):
    """Embedding, attention over a padded batch (a fully padded sequence too), LayerNorm, and a
    mean-pooled classifier."""

    @nn.compact
    def __call__(self, tokens, pad):
        x = nn.Embed(16, 16)(tokens)
        mask = nn.make_attention_mask(pad, pad)
        x = nn.LayerNorm()(x + nn.MultiHeadDotProductAttention(num_heads=2)(x, mask=mask))
        with jax.named_scope("mlp"):
            x = nn.LayerNorm()(x + nn.Dense(16)(nn.gelu(nn.Dense(32)(x))))
        return nn.Dense(3)(x.mean(1))


def test_linen_transformer_with_padding_by_path_scope_and_function():
    model = PaddedEncoder()
    tokens = jax.random.randint(jax.random.key(0), (3, 5), 0, 16)
    pad = jnp.arange(5)[None] < jnp.array([5, 2, 0])[:, None]
    labels = jnp.array([0, 1, 2])
    params = jax.jit(model.init)(jax.random.key(1), tokens, pad)["params"]

    def loss(params, tokens, pad):
        logits = model.apply({"params": params}, tokens, pad)
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    rules = [("LayerNorm_*", jnp.float32), ("MultiHeadDotProductAttention_0/query", "float32"),
             ("jax.nn.gelu", "off"), ("mlp", jnp.bfloat16)]
    auto = jamp.autocast(loss, device_type="cuda", rules=rules)
    found = ops(auto, params, tokens, pad)
    assert dtypes_of(found, "dot_general", inside="query") == [(F32, F32)]
    assert set(dtypes_of(found, "dot_general", inside="mlp")) == {(BF16, BF16)}
    assert set(dtypes_of(found, "dot_general", outside="mlp")) - {(F32, F32)} == {(F16, F16)}
    assert {d for p, n, ins, _ in found if "LayerNorm" in p for d in ins} == {F32}
    assert set(dtypes_of(found, "tanh")) == {(F32,)}  # gelu off: the program's float32
    value, grads = jax.jit(jax.value_and_grad(auto))(params, tokens, pad)
    want, want_grads = jax.jit(jax.value_and_grad(loss))(params, tokens, pad)
    assert rel_err(value, want) < 2e-2
    flat = lambda t: jnp.concatenate([g.ravel() for g in jax.tree.leaves(t)])
    assert np.isfinite(flat(grads)).all() and rel_err(flat(grads), flat(want_grads)) < 5e-2


class ConvNet(nnx.Module):
    def __init__(self, rngs):
        self.conv = nnx.Conv(1, 4, (3, 3), rngs=rngs)
        self.bn = nnx.BatchNorm(4, rngs=rngs)
        self.head = nnx.Linear(4, 3, rngs=rngs)

    def __call__(self, x):
        return self.head(jax.nn.relu(self.bn(self.conv(x))).mean((1, 2)))


def test_nnx_cnn_with_batchnorm_kept_in_float32_trains_under_jit():
    model, reference = ConvNet(nnx.Rngs(0)), ConvNet(nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(2), (4, 6, 6, 1))

    def loss(m, x):
        return jnp.mean(m(x) ** 2)

    auto = jamp.autocast(loss, device_type="cpu", rules=[("bn", jnp.float32)])
    value, grads = nnx.jit(nnx.value_and_grad(auto))(model, x)
    want, want_grads = nnx.jit(nnx.value_and_grad(loss))(reference, x)
    assert rel_err(value, want) < 2e-2
    assert rel_err(grads.head.kernel[...], want_grads.head.kernel[...]) < 5e-2
    assert rel_err(model.bn.mean[...], reference.bn.mean[...]) < 1e-2  # statistics moved
    model.eval()
    found = ops(jamp.autocast(lambda x: model(x), device_type="cpu", cast_outputs=False,
                              rules=[("bn", jnp.float32)]), x)
    assert {d for p, name, ins, _ in found if p.endswith("/bn")
            and name != "convert_element_type" for d in ins} == {F32}
    assert dtypes_of(found, "conv_general_dilated") == [(BF16, BF16)]


class ScanBlock(nn.Module):
    @nn.compact
    def __call__(self, c, _):
        return nn.LayerNorm()(c + nn.Dense(8, name="mlp")(c)), None


class LinenScanned(nn.Module):
    @nn.compact
    def __call__(self, x):
        layers = nn.scan(nn.remat(ScanBlock), variable_axes={"params": 0},
                         split_rngs={"params": True}, length=3)
        return layers(name="layers")(nn.Dense(8)(x), None)[0]


class NnxScanned(nnx.Module):
    def __init__(self, rngs):
        @nnx.split_rngs(splits=3)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make(rngs):
            return nnx.Linear(8, 8, rngs=rngs)

        self.stem = nnx.Linear(8, 8, rngs=rngs)
        self.layers = make(rngs)

    def __call__(self, x):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def step(x, layer):
            return x + jax.nn.gelu(layer(x))

        return step(self.stem(x), self.layers)


def test_scan_over_layers_linen_and_nnx():
    x = jax.random.normal(jax.random.key(3), (2, 8))
    model = LinenScanned()
    variables = jax.jit(model.init)(jax.random.key(4), x)
    auto = jamp.autocast(model.apply, device_type="cpu", cast_outputs=False,
                         rules=[("layers/mlp", jnp.float32)])
    found = ops(auto, variables, x)
    assert dtypes_of(found, "dot_general", inside="layers/mlp") == [(F32, F32)]
    assert dtypes_of(found, "dot_general", outside="layers") == [(BF16, BF16)]
    assert rel_err(jax.jit(auto)(variables, x), model.apply(variables, x)) < 2e-2
    # NNX: the layer nnx.scan hands its body is rebuilt inside it, named by its class.
    stack = NnxScanned(nnx.Rngs(0))
    forward = jamp.autocast(lambda x: stack(x), device_type="cpu", cast_outputs=False,
                            rules=[("NnxScanned/Linear", jnp.float32)])
    found = ops(forward, x)
    assert dtypes_of(found, "dot_general") == [(BF16, BF16), (F32, F32)]
    assert rel_err(jax.jit(forward)(x), stack(x)) < 2e-2


def test_a_planted_overflow_is_fixed_by_one_rule():
    class Scaled(nn.Module):  # squares activations scaled by 300: beyond float16's 65504
        @nn.compact
        def __call__(self, h):
            s = h * 300.0
            return nn.Dense(4)(s * s) * 1e-5

    class Planted(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(4)(Scaled()(nn.Dense(8)(x)))

    model, x = Planted(), jax.random.normal(jax.random.key(5), (4, 8)) * 3
    params = jax.jit(model.init)(jax.random.key(6), x)["params"]
    loss = lambda p, x: jnp.mean(model.apply({"params": p}, x) ** 2)
    broken = jamp.autocast(loss, device_type="cuda")
    assert not np.isfinite(jax.jit(broken)(params, x))
    fixed = jamp.autocast(loss, device_type="cuda", rules=[("Scaled_0", jnp.float32)])
    value, grads = jax.jit(jax.value_and_grad(fixed))(params, x)
    assert rel_err(value, loss(params, x)) < 1e-2
    assert all(np.isfinite(g).all() for g in jax.tree.leaves(grads))
    found = ops(fixed, params, x)
    assert dtypes_of(found, "dot_general", outside="Scaled_0") == [(F16, F16)] * 2


# -- the op tables' function rules ------------------------------------------------------------

@pytest.mark.parametrize("device_type", ["cpu", "cuda", "tpu"])
def test_every_table_function_rule_names_a_function(device_type):
    table = autocast_table(device_type)
    assert len(rule_set((), table).rules) == len(table.functions) > 0


def test_unreduced_optax_losses_compute_in_float32():
    # torch's float32 lists hold the losses, reduced or not (reduction="none").
    y = (X > 0).astype(jnp.float32)
    f = lambda x, w: optax.sigmoid_binary_cross_entropy(x @ w, y)

    def below_float32(table):
        found = ops(jamp.autocast(f, op_table=table, cast_outputs=False), X, W)
        return {name for _, name, ins, _ in found if name not in ("dot_general",
                "convert_element_type") and any(d != F32 for d in ins)}

    assert below_float32(autocast_table("cpu")) == below_float32(autocast_table("cuda")) == set()
    # Without the table's function rules, the cpu table computes its logs in bfloat16.
    assert "log1p" in below_float32(dataclasses.replace(autocast_table("cpu"), functions=()))


def test_table_function_rules_per_device():
    low = lambda f, device: [o.dtype for o in jax.eval_shape(
        jamp.autocast(f, device_type=device, cast_outputs=False), X, W)]
    # cpu: quantiles, pads and cosine similarity as torch's CPU kernels return them.
    cpu = lambda x, w: (jnp.quantile(x @ w, 0.3, axis=-1), jnp.pad(x @ w, 1, mode="edge"),
                        optax.cosine_similarity(x @ w, x), x @ w)
    assert low(cpu, "cpu") == [F32, F32, F32, BF16]
    # cuda: powers, reciprocals and `scalar / x` in float32, but gelu's `x ** 3` and ordinary
    # division stay in float16 as in torch.
    cuda = lambda x, w: (jax.nn.gelu(x @ w), (x @ w) ** 2, jnp.reciprocal(x @ w),
                         1.0 / (x @ w), (x @ w) / 2.0)
    assert low(cuda, "cuda") == [F16, F32, F32, F32, F16]


@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
def test_float32_list_functions_return_float32_whatever_their_inputs(device_type):
    # torch's float32 lists cast every floating input to float32, a bfloat16 one the program
    # typed too, and return float32. jnp and optax cast their inputs to one another's dtype
    # and their result back to their inputs': those casts are the kernel's own. Before:
    # bfloat16 wherever the first input was.
    low = lambda x: x.astype(BF16)
    losses = lambda x: (
        optax.sigmoid_binary_cross_entropy(low(x), (x > 0).astype(F32)),
        optax.softmax_cross_entropy(low(x), low(jax.nn.softmax(x))),
        optax.hinge_loss(low(x), low(jnp.sign(x))),
        optax.losses.multiclass_hinge_loss(low(x), jnp.arange(3)))
    quantiles = lambda x: (jnp.quantile(low(x), 0.3, axis=-1),
                           jnp.nanquantile(low(x), jnp.float32(0.3), axis=-1))
    f = jamp.autocast(lambda x: (losses(x), quantiles(x) if device_type == "cpu" else ()),
                      device_type=device_type, cast_outputs=False)
    assert {o.dtype for o in jax.tree.leaves(jax.eval_shape(f, X))} == {F32}


@pytest.mark.parametrize("device_type, low", [("cpu", BF16), ("cuda", F16)])
def test_prelu_is_one_lower_precision_kernel(device_type, low):
    # torch's lower-precision lists (CPU and CUDA) hold prelu: its input and weight are cast
    # to the low dtype, a float32 input included. Before: float32.
    linen = nn.PReLU()
    params = linen.init(jax.random.key(0), X)
    module = nnx.PReLU()
    for f in (lambda x: linen.apply(params, x), lambda x: module(x)):
        transformed = jamp.autocast(f, device_type=device_type, cast_outputs=False)
        assert jax.eval_shape(transformed, X).dtype == low
        computed = {d for _, name, ins, _ in ops(transformed, X)
                    if name != "convert_element_type" for d in ins}
        assert computed == {low}


def test_cosine_similarity_promotes_its_inputs_before_it_computes():
    # torch's CPU cosine_similarity casts its inputs to their promoted dtype, then computes:
    # two bfloat16 activations give bfloat16; a bfloat16 input the program typed beside a
    # float32 one computes both norms in float32. Before: float32 for the first (values
    # autocast lowered read back in float32), the bfloat16 norm in bfloat16 for the second.
    cos = lambda f: jamp.autocast(f, device_type="cpu", cast_outputs=False)
    both = cos(lambda x, w: optax.cosine_similarity(x @ w, x @ w))
    assert jax.eval_shape(both, X, W).dtype == BF16
    typed = cos(lambda x: optax.cosine_similarity(x.astype(BF16), x))
    assert jax.eval_shape(typed, X).dtype == F32
    assert {d for _, name, ins, _ in ops(typed, X) if name != "convert_element_type"
            for d in ins} == {F32}
