"""fp8 recipes as precision settings: the linear layers of the modules a rule selects multiply
in float8 through `jamp.fp8`, the rest of the region keeps its dtype (docs/fp8.md, "Choosing
modules"). Dtypes are read from the jaxpr of the transformed function."""

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jamp
from jamp.transforms.autocast_fp8 import Fp8ShapeWarning

from helpers import jaxpr_eqns

TENSORWISE = jamp.fp8.recipe("tensorwise")


def float8_casts(fn, *args) -> list[str]:
    """The float8 dtype of each cast to float8 in `fn`'s jaxpr (bodies included)."""
    jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
    return [np.dtype(e.params["new_dtype"]).name for e in jaxpr_eqns(jaxpr, "convert_element_type")
            if np.dtype(e.params["new_dtype"]).itemsize == 1
            and "float8" in np.dtype(e.params["new_dtype"]).name]


def dot_dtypes(fn, *args) -> list[tuple[str, str]]:
    """(operand dtype, result dtype) of each dot_general of `fn`'s jaxpr (bodies included)."""
    jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
    return [(np.dtype(e.invars[0].aval.dtype).name, np.dtype(e.outvars[0].aval.dtype).name)
            for e in jaxpr_eqns(jaxpr, "dot_general")]


class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(16)(nn.relu(nn.Dense(16)(x)))


class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(16, name="head")(Block()(Block()(x)))


@pytest.fixture(scope="module")
def net():
    x = jnp.linspace(-2.0, 2.0, 4 * 16).reshape(4, 16)
    model = Net()
    return model, model.init(jax.random.key(0), x), x


def test_rule_selects_the_blocks_linear_layers_and_the_head_stays_bfloat16(net):
    model, variables, x = net
    apply = jamp.autocast(model.apply, dtype=jnp.bfloat16,
                          rules=[("head", jnp.bfloat16), ("Block_*", TENSORWISE)])
    # Four Dense layers, each casting its input and its kernel to e4m3; the head none.
    assert float8_casts(apply, variables, x) == ["float8_e4m3fn"] * 8
    # The head multiplies bfloat16 operands (accumulating in float32, where its bias is added,
    # as torch's linear does); the fp8 products multiply the float8 values with a float32
    # accumulator.
    assert dot_dtypes(apply, variables, x).count(("bfloat16", "float32")) == 1
    assert dot_dtypes(apply, variables, x).count(("float8_e4m3fn", "float32")) == 4
    # The backward casts the output gradient to e5m2 (tensorwise's grad_input, grad_weight).
    grad = jax.grad(lambda v: apply(v, x).sum())
    assert float8_casts(grad, variables).count("float8_e5m2") == 8
    assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(jax.eval_shape(grad, variables)))


def test_a_layer_under_float32_equals_jamp_fp8_dot_general():
    x = jnp.linspace(-3.0, 3.0, 4 * 16).reshape(4, 16)
    layer = nn.Dense(16)
    variables = layer.init(jax.random.key(1), x)
    apply = jax.jit(jamp.autocast(layer.apply, dtype=jnp.float32, rules=[("**", TENSORWISE)]))
    params = variables["params"]
    expected = jamp.fp8.dot_general(x, params["kernel"], (((1,), (0,)), ((), ())),
                                    TENSORWISE) + params["bias"]
    out = apply(variables, x)
    assert out.dtype == jnp.float32
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)
    # ... and differs from the float32 layer by float8's rounding.
    assert float(jnp.abs(out - layer.apply(variables, x)).max()) > 1e-3


def test_recipe_as_autocast_dtype_runs_every_linear_layer_in_fp8(net):
    model, variables, x = net
    apply = jamp.autocast(model.apply, dtype=TENSORWISE)
    assert float8_casts(apply, variables, x) == ["float8_e4m3fn"] * 10
    with pytest.raises(ValueError, match="applies to a transform"):
        with jamp.autocast(dtype=TENSORWISE):
            pass


def test_nnx_linear_conv_and_einsum_and_linen_scan_remat_conv_einsum():
    class Model(nnx.Module):
        def __init__(self):
            self.linear = nnx.Linear(16, 16, rngs=nnx.Rngs(0))
            self.conv = nnx.Conv(16, 16, (3,), rngs=nnx.Rngs(0))
            self.einsum = nnx.Einsum("btd,dk->btk", (16, 16), rngs=nnx.Rngs(0))

        def __call__(self, x):
            return self.einsum(self.conv(self.linear(x)))

    x = jnp.ones((2, 8, 16))
    run = jamp.autocast(lambda m, x: m(x), dtype=jnp.bfloat16,
                        rules=[("linear", TENSORWISE), ("conv", TENSORWISE),
                               ("einsum", TENSORWISE)])
    assert float8_casts(run, Model(), x) == ["float8_e4m3fn"] * 6

    class Layer(nn.Module):
        @nn.compact
        def __call__(self, x, _):
            return nn.Dense(16)(x), None

    class Stack(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.Einsum((16, 16), "btd,dk->btk")(nn.Conv(16, (3,))(x))
            layers = nn.scan(nn.remat(Layer), variable_axes={"params": 0},
                             split_rngs={"params": True}, length=2)
            return layers()(x, None)[0]

    model = Stack()
    variables = model.init(jax.random.key(0), x)
    apply = jamp.autocast(model.apply, dtype=jnp.bfloat16, rules=[("**", TENSORWISE)])
    # conv, einsum, and the scanned Dense once in the scan's body.
    assert float8_casts(apply, variables, x) == ["float8_e4m3fn"] * 6
    assert float8_casts(jax.vmap(apply, in_axes=(None, 0)), variables, x[None]) == (
        ["float8_e4m3fn"] * 6)
    # Differentiated through the remat and the scan: the backward's e5m2 casts are there.
    grad = jax.grad(lambda v: apply(v, x).astype(jnp.float32).sum())
    assert float8_casts(grad, variables).count("float8_e5m2") == 6


def test_attention_matmuls_stay_unless_a_function_rule_names_them():
    class Attention(nn.Module):
        @nn.compact
        def __call__(self, x):
            q = nn.Dense(16)(x)[..., None, :]
            return nn.dot_product_attention(q, q, q)

    x = jnp.ones((2, 16, 16))
    model = Attention()
    variables = model.init(jax.random.key(0), x)
    module_rule = jamp.autocast(model.apply, dtype=jnp.bfloat16, rules=[("**", TENSORWISE)])
    assert float8_casts(module_rule, variables, x) == ["float8_e4m3fn"] * 2
    named = jamp.autocast(model.apply, dtype=jnp.bfloat16,
                          rules=[("flax.linen.dot_product_attention", TENSORWISE),
                                 ("**", TENSORWISE)])
    assert float8_casts(named, variables, x) == ["float8_e4m3fn"] * 6


def test_float8_dtype_and_unmatched_rule_are_refused(net):
    model, variables, x = net
    with pytest.raises(TypeError, match=r'jamp\.fp8\.recipe\("tensorwise"\)'):
        jamp.autocast(model.apply, rules=[("Block_*", jnp.float8_e4m3fn)])
    with pytest.raises(TypeError, match=r'jamp\.fp8\.recipe\("tensorwise"\)'):
        jamp.autocast(model.apply, dtype=jnp.float8_e4m3fn)
    with pytest.raises(ValueError, match="'Blok_\\*' matched nothing"):
        jamp.autocast(model.apply, rules=[("Blok_*", TENSORWISE)])(variables, x)


def test_a_layer_fp8_gemms_cannot_serve_is_named_with_its_shape():
    x = jnp.ones((4, 16))

    class WithNarrow(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(10, name="narrow")(x)

    model = WithNarrow()
    variables = model.init(jax.random.key(0), x)
    # Selected by a rule, or by the recipe as autocast's dtype (no rules): named the same.
    for transformed in (jamp.autocast(model.apply, rules=[("narrow", TENSORWISE)]),
                        jamp.autocast(model.apply, dtype=TENSORWISE)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            jax.make_jaxpr(transformed)(variables, x)
        messages = [str(w.message) for w in caught if issubclass(w.category, Fp8ShapeWarning)]
        assert len(messages) == 1 and "'WithNarrow/narrow'" in messages[0]
        assert "(16, 10)" in messages[0]


def test_shard_map_and_custom_vjp_bodies_run_their_linear_layers_in_fp8():
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    kernel = jnp.ones((16, 16))
    x = jnp.ones((8, 16))

    @jax.custom_vjp
    def layer(x, kernel):
        return x @ kernel

    layer.defvjp(lambda x, k: (layer(x, k), (x, k)), lambda res, g: (g @ res[1].T, res[0].T @ g))

    def sharded(x, kernel):
        return jax.shard_map(lambda x, k: jnp.tanh(layer(x, k)), mesh=mesh,
                             in_specs=(jax.P("data"), jax.P()), out_specs=jax.P("data"))(x, kernel)

    apply = jamp.autocast(sharded, dtype=jnp.bfloat16, rules=[("**", TENSORWISE)])
    assert float8_casts(apply, x, kernel) == ["float8_e4m3fn"] * 2
    assert jax.jit(apply)(x, kernel).dtype == jnp.float32



@pytest.mark.parametrize("level", ["O1", "O2"])
def test_initialize_apply_takes_fp8_rules(net, level):
    model, variables, x = net
    apply_fn, amp_variables, _ = jamp.initialize(model.apply, variables, optax.sgd(0.1),
                                                 opt_level=level, verbosity=0)
    apply = jamp.autocast(apply_fn, dtype=jnp.float16, rules=[("Block_*", TENSORWISE)])
    assert float8_casts(apply, amp_variables, x) == ["float8_e4m3fn"] * 8
    # The head multiplies float16 operands at both levels (accumulating in float32).
    assert ("float16", "float32") in dot_dtypes(apply, amp_variables, x)


def test_a_rule_every_equation_of_which_an_inner_region_sets_again_is_refused(net):
    # O1's apply function is an autocast region of its own (float16) inside the model: a rule
    # that matches the whole model from the top is overridden by it everywhere, and would put
    # no layer in fp8. It says so rather than doing nothing.
    model, variables, x = net
    apply_fn, amp_variables, _ = jamp.initialize(model.apply, variables, optax.sgd(0.1),
                                                 opt_level="O1", verbosity=0)
    apply = jamp.autocast(apply_fn, rules=[("**", TENSORWISE)])
    with pytest.raises(ValueError, match=r"'\*\*' decides nothing .* sets its own dtype"):
        jax.eval_shape(apply, amp_variables, x)
    # The same rule on the model itself, where no region sits inside, puts every layer in fp8.
    everything = jamp.autocast(model.apply, rules=[("**", TENSORWISE)])
    assert len(float8_casts(everything, variables, x)) > 8


def test_an_on_rule_and_a_region_with_its_own_dtype_carve_layers_out(net):
    model, variables, x = net
    carved = jamp.autocast(model.apply, dtype=jnp.bfloat16,
                           rules=[("Block_0/Dense_1", "on"), ("Block_*", TENSORWISE)])
    assert float8_casts(carved, variables, x) == ["float8_e4m3fn"] * 6

    class FloatRegion(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.Dense(16)(x)
            with jamp.autocast(dtype=jnp.float32):
                return nn.Dense(16)(x)

    region_model = FloatRegion()
    region_variables = region_model.init(jax.random.key(0), x)
    apply = jamp.autocast(region_model.apply, dtype=jnp.bfloat16, rules=[("**", TENSORWISE)])
    # The region inside the module names its dtype: its Dense runs in float32, not fp8.
    assert float8_casts(apply, region_variables, x) == ["float8_e4m3fn"] * 2


@pytest.mark.parametrize("wrap", [lambda f: f, jax.checkpoint, jax.jit],
                         ids=["plain", "checkpoint", "jit"])
def test_a_grad_inside_the_function_runs_its_backward_products_in_the_region_dtype(wrap):
    # A gradient penalty: the function itself calls jax.grad, so its jaxpr holds the inner
    # backward pass's products as plain dot_generals (the output gradient times the kernel,
    # the input times the output gradient). They are not the recipe's backward GEMMs (jamp
    # cannot tell which operand is the output gradient): they run in the region's dtype; the
    # forward products run in fp8 (docs/fp8.md, "A jax.grad inside the function"), also where
    # the differentiated function is a call (its backward pass a call's body).
    model = nn.Dense(16)
    x = jnp.linspace(-2.0, 2.0, 4 * 16).reshape(4, 16)
    variables = model.init(jax.random.key(0), x)

    def penalized(variables, x):
        grads = jax.grad(wrap(lambda v, x: model.apply(v, x).sum()), argnums=(0, 1))(
            variables, x)
        return model.apply(variables, x).sum() + sum(jnp.sum(g ** 2)
                                                     for g in jax.tree.leaves(grads))

    apply = jamp.autocast(penalized, dtype=jnp.bfloat16, rules=[("**", TENSORWISE)])
    # Two forward products (the inner grad's primal and the outer call) in float8, the inner
    # grad_input and grad_weight products in bfloat16.
    assert sorted(dot_dtypes(apply, variables, x)) == (
        [("bfloat16", "bfloat16")] * 2 + [("float8_e4m3fn", "float32")] * 2)
    assert float8_casts(apply, variables, x) == ["float8_e4m3fn"] * 4
    # Differentiating the transformed function gives the recipe's backward GEMMs to its
    # forward products: the outer call's output gradient, cast to e5m2 for grad_input and
    # grad_weight (the inner grad's primal product reaches no output).
    grad = jax.grad(lambda v: apply(v, x))
    assert float8_casts(grad, variables).count("float8_e5m2") == 2


def test_a_custom_jvp_holding_a_linear_layer_is_differentiated_through_its_fp8_products():
    # A jvp rule cannot run the float8 GEMMs' backward (JAX transposes what the rule computes,
    # and a float8 cast of a tangent is not linear): the function is differentiated through
    # the products' own rules, as the forward runs them.
    @jax.custom_jvp
    def layer(x, w):
        return x @ w

    layer.defjvp(lambda primals, tangents: (layer(*primals),
                                            tangents[0] @ primals[1] + primals[0] @ tangents[1]))
    x, w = jnp.ones((16, 32)), jnp.full((32, 16), 0.5)
    auto = jamp.autocast(lambda w: jnp.sum(layer(x, w).astype(jnp.float32)), dtype=TENSORWISE)
    grad = jax.grad(auto)
    np.testing.assert_allclose(grad(w), jax.grad(lambda w: jnp.sum(layer(x, w)))(w), rtol=1e-2)
    # The output gradient cast to e5m2 for both backward GEMMs (grad_input, grad_weight).
    assert float8_casts(grad, w).count("float8_e5m2") == 2
