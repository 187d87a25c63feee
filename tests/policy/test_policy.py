"""Policy and get_policy: jmp's API and spellings, checked against jmp itself."""

import jax
import jax.numpy as jnp
import jmp
import numpy as np
import pytest

import jamp.policy as policy_lib
from jamp.policy import Policy, get_policy

from helpers import BF16, F16, F32, F64

HALF = F16  # half_dtype() on CPU and GPU

# (spelling, (param, compute, output))
SPELLINGS = [
    ("float32", (F32, F32, F32)),
    ("f32", (F32, F32, F32)),
    ("full", (F32, F32, F32)),
    ("fp32", (F32, F32, F32)),
    ("float16", (F16, F16, F16)),
    ("f16", (F16, F16, F16)),
    ("fp16", (F16, F16, F16)),
    ("bfloat16", (BF16, BF16, BF16)),
    ("bf16", (BF16, BF16, BF16)),
    ("half", (HALF, HALF, HALF)),
    ("float64", (F64, F64, F64)),
    ("f64", (F64, F64, F64)),
    ("params=float32,compute=bfloat16,output=float32", (F32, BF16, F32)),
    ("p=f32,c=bf16,o=f32", (F32, BF16, F32)),
    ("p=full,c=half,o=full", (F32, HALF, F32)),
    ("p=f32,c=f16", (F32, F16, F16)),
    ("c=f16", (F32, F16, F16)),
    ("c=bf16,o=full", (F32, BF16, F32)),
    ("p=f16,c=f16", (F16, F16, F16)),
    ("p=f16,c=bf16", (F16, BF16, BF16)),
    ("params=bf16", (BF16, BF16, BF16)),
    ("o=f16", (F32, F32, F16)),
    ("output=bfloat16,params=float32", (F32, F32, BF16)),
    (" P=F32 , C=BF16 ", (F32, BF16, BF16)),
]

# Spellings jmp itself accepts (it knows no fp16/fp32 and no upper case), side by side.
JMP_SPELLINGS = [
    "float32", "f32", "full", "float16", "f16", "bfloat16", "bf16", "half", "float64", "f64",
    "params=float32,compute=bfloat16,output=float32", "p=f32,c=bf16,o=f32",
    "p=full,c=half,o=full", "p=f32,c=f16", "c=f16", "c=bf16,o=full", "p=f16,c=bf16", "o=f16",
]


@pytest.mark.parametrize("spelling,expected", SPELLINGS)
def test_get_policy_spellings(spelling, expected):
    policy = get_policy(spelling)
    assert (policy.param_dtype, policy.compute_dtype, policy.output_dtype) == expected


@pytest.mark.parametrize("spelling", JMP_SPELLINGS)
def test_get_policy_matches_jmp(spelling):
    ours, theirs = get_policy(spelling), jmp.get_policy(spelling)
    assert ours.param_dtype == theirs.param_dtype
    assert ours.compute_dtype == theirs.compute_dtype
    assert ours.output_dtype == theirs.output_dtype
    assert str(ours) == str(theirs)


@pytest.mark.parametrize("bad,named", [
    ("compute_float16", "compute_float16"),
    ("float17", "float17"),
    ("p=f32,c=bfloat15", "bfloat15"),
    ("params=float32,compute=bf16,outputs=float32", "outputs"),
    ("q=f32", "'q'"),
    ("p=f32,,c=f16", "''"),
    ("", "''"),
])
def test_get_policy_rejects_near_misses(bad, named):
    with pytest.raises(ValueError, match=named) as info:
        get_policy(bad)
    message = str(info.value)
    assert "float16" in message or "compute" in message  # the accepted spellings are named


def test_near_miss_suggests_the_fix():
    with pytest.raises(ValueError, match="compute=float16"):
        get_policy("compute_float16")


def test_duplicate_key_is_an_error():
    with pytest.raises(ValueError, match="twice"):
        get_policy("p=f32,params=f16")


def test_get_policy_passes_a_policy_through():
    policy = Policy(jnp.float32, jnp.bfloat16, jnp.float32)
    assert get_policy(policy) is policy


def test_policy_is_frozen_hashable_and_compares_with_any_dtype_spelling():
    a = Policy(jnp.float32, jnp.bfloat16, jnp.float32)
    b = Policy(np.float32, "bfloat16", np.dtype("float32"))
    assert a == b and hash(a) == hash(b)
    assert a.compute_dtype == jnp.bfloat16
    assert {a: 1}[get_policy("p=f32,c=bf16,o=f32")] == 1
    with pytest.raises(Exception):
        a.param_dtype = jnp.float16


def test_policy_usable_as_static_jit_argument():
    run = jax.jit(lambda x, policy: policy.cast_to_compute(x) * 2, static_argnums=1)
    assert run(jnp.ones(3), get_policy("c=bf16")).dtype == BF16
    assert run(jnp.ones(3), get_policy("c=f16")).dtype == F16


@pytest.mark.parametrize("bad", [jnp.int32, "int8", bool, "not-a-dtype"])
def test_policy_rejects_non_floating_dtypes(bad):
    with pytest.raises(ValueError, match="param_dtype"):
        Policy(bad, jnp.float32, jnp.float32)


def test_with_output_dtype():
    policy = get_policy("p=f32,c=bf16,o=bf16").with_output_dtype(jnp.float32)
    assert (policy.param_dtype, policy.compute_dtype, policy.output_dtype) == (F32, BF16, F32)


@pytest.mark.parametrize("spelling,text", [
    ("p=f32,c=bf16,o=f32", "p=full,c=bf16,o=full"),
    ("f16", "p=f16,c=f16,o=f16"),
    ("p=f64,c=f32", "p=f64,c=full,o=full"),
])
def test_str(spelling, text):
    assert str(get_policy(spelling)) == text


def test_half_dtype_on_this_backend():
    expected = BF16 if jax.default_backend() == "tpu" else F16
    assert policy_lib.half_dtype() == expected
    assert policy_lib.half_dtype() == jmp.half_dtype()


def test_policy_keys_serve_both_the_parser_and_the_dtype_hint():
    # dtypes.POLICY_KEYS: get_policy parses with the keys, parse_dtype hints with them.
    assert get_policy("compute=bf16") == get_policy("c=bf16")
    with pytest.raises(ValueError, match="Did you mean 'compute=float16'"):
        policy_lib.parse_dtype("compute_float16")


def test_import_swap_runs_jmp_code():
    """A snippet written against jmp runs unchanged with `import jamp.policy as jmp`."""
    def user_code(jmp_module):
        policy = jmp_module.get_policy("params=float32,compute=float16,output=float32")
        params = {"w": jnp.ones((2, 2)), "step": jnp.array(3)}
        compute = policy.cast_to_compute(params)
        out = policy.cast_to_output(compute["w"] @ compute["w"])
        return str(policy), compute["w"].dtype, compute["step"].dtype, out.dtype, \
            jmp_module.cast_to_half(params)["w"].dtype, jmp_module.cast_to_full(compute)["w"].dtype

    assert user_code(policy_lib) == user_code(jmp)
