"""torch's autocast state queries, asked by the code a transform traces: `jamp.is_autocast_enabled`,
`jamp.get_autocast_dtype` and `jamp.is_autocast_available` answer what the region in force
there is (the transform, nested regions, a precision rule's module) and torch's defaults
outside every transform."""

from typing import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import jamp

from helpers import BF16, F16, F32, X


def state(device_type="cpu"):
    """What a layer ported from torch asks."""
    return jamp.is_autocast_enabled(device_type), jamp.get_autocast_dtype(device_type)


def test_outside_every_transform_the_answers_are_torchs_defaults(torch):
    for device in ("cpu", "cuda"):
        assert state(device) == (torch.is_autocast_enabled(device), {
            torch.bfloat16: BF16, torch.float16: F16}[torch.get_autocast_dtype(device)])
        assert jamp.is_autocast_available(device) is torch.amp.is_autocast_available(device)
    assert state("gpu") == state("rocm") == (False, F16)
    assert state("tpu") == (False, BF16)
    assert jamp.is_autocast_enabled() is False
    # A region outside a transform does nothing, and says so.
    with jamp.autocast(device_type="cpu", dtype=jnp.float16):
        assert state() == (False, BF16)


def test_availability_and_device_types():
    assert all(map(jamp.is_autocast_available, ["cpu", "cuda", "gpu", "rocm", "tpu"]))
    assert not jamp.is_autocast_available("mps")  # a torch device type jamp has no table for
    with pytest.raises(TypeError, match="must be a string"):
        jamp.is_autocast_available(0)
    with pytest.raises(ValueError, match=r"Unknown autocast device_type 'mps': expected one of "
                                         r"'cuda', 'gpu', 'rocm', 'cpu', 'tpu'"):
        jamp.get_autocast_dtype("mps")
    with pytest.raises(ValueError, match="Unknown autocast device_type 'cdua'"):
        jamp.is_autocast_enabled("cdua")


def nested(x, answers):
    """torch's nesting: the transform, autocast off inside it, float16 inside that."""
    answers.append(state())
    with jamp.autocast(enabled=False):
        answers.append(state())
        with jamp.autocast(dtype=jnp.float16):
            answers.append(state())
            x = x @ x.T
        answers.append(state())
    answers.append(state())
    answers.append(state("cuda"))  # another device type's autocast is not on
    return x


def test_regions_nest_as_torchs_do(variant, torch):
    answers = []
    variant(jamp.autocast(lambda x: nested(x, answers), device_type="cpu"))(X)
    names = {torch.bfloat16: BF16, torch.float16: F16}
    expected = []
    with torch.autocast("cpu"):
        expected.append(state_of(torch, "cpu", names))
        with torch.autocast("cpu", enabled=False):
            expected.append(state_of(torch, "cpu", names))
            with torch.autocast("cpu", dtype=torch.float16):
                expected.append(state_of(torch, "cpu", names))
            expected.append(state_of(torch, "cpu", names))
        expected.append(state_of(torch, "cpu", names))
        expected.append(state_of(torch, "cuda", names))
    assert answers == expected == [(True, BF16), (False, BF16), (True, F16), (False, BF16),
                                   (True, BF16), (False, F16)]


def state_of(torch, device, names):
    return torch.is_autocast_enabled(device), names[torch.get_autocast_dtype(device)]


def test_the_transforms_device_type_and_dtype_and_the_no_argument_form():
    answers = []

    def f(x):
        answers.append((jamp.is_autocast_enabled(), state("cuda"), state("gpu"), state("cpu")))
        return x

    jamp.autocast("cuda", jnp.bfloat16)(f)(X)
    default = jax.default_backend() in ("gpu", "cuda", "rocm")  # no device type: the default's
    assert answers == [(default, (True, BF16), (True, BF16), (False, BF16))]


def test_a_layer_casts_by_what_it_is_told():
    """The use torch users port: a layer that casts its input to the autocast dtype."""
    def layer(x):
        if jamp.is_autocast_enabled("cpu"):
            x = x.astype(jamp.get_autocast_dtype("cpu"))
        return jnp.tanh(x)

    def f(x):
        with jamp.autocast(enabled=False):
            return layer(x), layer(x * 2)

    assert jamp.autocast(lambda x: layer(x), device_type="cpu", cast_outputs=False)(X).dtype \
        == BF16
    assert [o.dtype for o in jamp.autocast(f, device_type="cpu", cast_outputs=False)(X)] == [
        F32, F32]


class Asking(nn.Module):
    record: Callable  # a list's append (linen would freeze a list field into a tuple)

    @nn.compact
    def __call__(self, x):
        self.record((self.name, state()))
        return nn.Dense(4)(x)


class Net(nn.Module):
    record: Callable

    @nn.compact
    def __call__(self, x):
        return Asking(self.record, name="low")(Asking(self.record, name="kept")(x))


@pytest.mark.parametrize("setting, kept", [(jnp.float32, (True, F32)), ("off", (False, BF16)),
                                           (jnp.float16, (True, F16))])
def test_a_linen_module_a_rule_moves_is_told_the_rules_setting(setting, kept):
    answers = []
    net = Net(answers.append)
    variables = net.init(jax.random.key(0), X)
    answers.clear()
    jax.jit(jamp.autocast(net.apply, device_type="cpu", rules=[("kept", setting)]))(variables, X)
    assert answers == [("kept", kept), ("low", (True, BF16))]


class NNXAsking(nnx.Module):
    def __init__(self, answers, rngs):
        self.answers = answers
        self.linear = nnx.Linear(4, 4, rngs=rngs)

    def __call__(self, x):
        self.answers.append(state())
        return self.linear(x)


def test_an_nnx_module_a_rule_moves_is_told_the_rules_setting():
    answers = []
    model = nnx.Sequential(NNXAsking(answers, nnx.Rngs(0)), NNXAsking(answers, nnx.Rngs(1)))
    apply = jamp.autocast(lambda m, x: m(x), device_type="cpu", rules=[("layers/0", "off")])
    apply(model, X)
    assert answers == [(False, BF16), (True, BF16)]


def test_a_jitted_body_sees_the_regions_opened_inside_it():
    """JAX traces a jit body on a name stack of its own (and reuses the trace): a layer there
    sees the transform and its own regions, not the regions around the call."""
    answers = []

    @jax.jit
    def body(x):
        answers.append(state())
        with jamp.autocast(dtype=jnp.float16):
            answers.append(state())
        return x

    def f(x):
        with jamp.autocast(enabled=False):
            return body(x)

    jamp.autocast(f, device_type="cpu")(X)
    assert answers == [(True, BF16), (True, F16)]
