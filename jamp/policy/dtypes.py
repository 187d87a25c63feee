"""The one home of jamp's dtype facts: the half and autocast dtypes, the predicates that
tell floating and inexact values apart, and dtype names and their parsing.

jmp's spellings are the reference: `full`/`f32`/`float32`, `half`, `f16`/`float16`,
`bf16`/`bfloat16`, `f64`/`float64`. jamp also accepts torch's `fp16`/`fp32`/`fp64`.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

FLOAT32 = np.dtype(np.float32)
FLOAT16 = np.dtype(jnp.float16)
BFLOAT16 = np.dtype(jnp.bfloat16)
# The half-precision dtypes autocast lowers to, and with float32 the dtypes it casts between
# (float64, integers, bools and complex values are never cast).
HALF_DTYPES: frozenset[np.dtype] = frozenset({FLOAT16, BFLOAT16})
AUTOCAST_DTYPES: frozenset[np.dtype] = HALF_DTYPES | {FLOAT32}
# The float8 dtypes fp8 training stores GEMM operands in (`jamp.fp8`): e4m3 for values that
# need precision (activations, weights), e5m2 for the range of gradients.
FLOAT8_E4M3 = np.dtype(jnp.float8_e4m3fn)
FLOAT8_E5M2 = np.dtype(jnp.float8_e5m2)
FP8_DTYPES: frozenset[np.dtype] = frozenset({FLOAT8_E4M3, FLOAT8_E5M2})


def dtype_of(x: Any) -> np.dtype | None:
    """The numpy dtype of anything that has one (an array, a tracer, an abstract value, a
    `jax.ShapeDtypeStruct`, a numpy scalar, a dtype itself); None for what has none a numpy
    dtype can name (PRNG keys, tokens, Python objects).

    >>> import jax.numpy as jnp
    >>> from jamp.policy.dtypes import dtype_of
    >>> dtype_of(jnp.ones(2, jnp.bfloat16)), dtype_of(object())
    (dtype(bfloat16), None)
    """
    if isinstance(x, np.dtype):
        return x
    dtype = getattr(x, "dtype", None)
    if dtype is None:
        return None
    try:
        return np.dtype(dtype)
    except TypeError:  # an extended dtype (a key's) has no numpy dtype
        return None


def is_floating(x: Any) -> bool:
    """True for a value or abstract value of a real floating dtype (float0 is not one)."""
    dtype = dtype_of(x)
    return dtype is not None and bool(jnp.issubdtype(dtype, jnp.floating))


def is_inexact(x: Any) -> bool:
    """True for a value or abstract value of a floating or complex dtype: what carries a
    gradient (float0, the tangent type of integers, does not)."""
    dtype = dtype_of(x)
    return dtype is not None and bool(jnp.issubdtype(dtype, jnp.inexact))


def is_wide(x: Any) -> bool:
    """True for a value or abstract value of float64 or a complex dtype: wider than autocast
    ever casts (an op on one runs as the program wrote it)."""
    dtype = dtype_of(x)
    return dtype is not None and (dtype == np.float64 or bool(
        jnp.issubdtype(dtype, jnp.complexfloating)))


def is_half(x: Any) -> bool:
    """True for a value or abstract value of float16 or bfloat16."""
    return dtype_of(x) in HALF_DTYPES


def is_half_dtype(value: Any) -> bool:
    """True when `value` itself names float16 or bfloat16 (a dtype, a scalar type such as
    `jnp.bfloat16`); False for anything else, strings and arrays included."""
    if not isinstance(value, (np.dtype, type)):
        return False
    try:
        return np.dtype(value) in HALF_DTYPES
    except TypeError:
        return False


def is_fp8_dtype(value: Any) -> bool:
    """True when `value` itself names a float8 dtype (`jnp.float8_e4m3fn`, its numpy dtype,
    the string "float8_e5m2", ...); False for anything else, arrays included."""
    if not isinstance(value, (np.dtype, type, str)):
        return False
    try:
        return bool(jnp.issubdtype(np.dtype(value), jnp.floating)) and np.dtype(value).itemsize == 1
    except TypeError:
        return False


def is_floating_array(x: Any) -> bool:
    """True for a JAX or numpy array (or tracer) of a real floating dtype: the pytree leaves a
    cast touches. Python scalars are not arrays and are left as they are."""
    return isinstance(x, (jax.Array, np.ndarray)) and is_floating(x)


def is_inexact_array(x: Any, *, python_scalars: bool = False) -> bool:
    """True for a JAX or numpy array (or tracer) of a floating or complex dtype, and, with
    `python_scalars`, for a Python float or complex (a loss scale multiplies those too)."""
    if python_scalars and isinstance(x, (float, complex)):
        return True
    return isinstance(x, (jax.Array, np.ndarray)) and is_inexact(x)


class _ByDtype(Mapping):
    """A read-only mapping keyed by dtype that takes any spelling of one as a key.

    jmp's `dtype_to_names` is indexed with `jnp.float16`, `np.float16` or a dtype object alike;
    those hash differently, so the keys are normalized with `np.dtype` on every lookup.
    """

    def __init__(self, items: dict[Any, tuple[str, ...]]):
        self._items = {np.dtype(k): v for k, v in items.items()}

    def __getitem__(self, key: Any) -> tuple[str, ...]:
        try:
            dtype = np.dtype(key)
        except TypeError:
            raise KeyError(key) from None
        return self._items[dtype]

    def __iter__(self) -> Iterator[np.dtype]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __repr__(self) -> str:
        return repr(self._items)


# First name of each tuple is the short form used by `Policy.__str__`.
DTYPE_NAMES: Mapping[Any, tuple[str, ...]] = _ByDtype({
    jnp.bfloat16: ("bf16", "bfloat16"),
    jnp.float16: ("f16", "float16", "fp16"),
    jnp.float32: ("full", "f32", "float32", "fp32"),
    jnp.float64: ("f64", "float64", "fp64"),
})

NAME_TO_DTYPE: dict[str, np.dtype] = {
    name: dtype for dtype, names in DTYPE_NAMES.items() for name in names
}

ACCEPTED_DTYPE_NAMES = ("half",) + tuple(NAME_TO_DTYPE)


def half_dtype() -> np.dtype:
    """The half-precision dtype of the default backend: bfloat16 on TPU, float16 elsewhere."""
    on_tpu = jax.local_devices()[0].platform == "tpu"
    return np.dtype(jnp.bfloat16 if on_tpu else jnp.float16)


def parse_dtype(name: str) -> np.dtype:
    """Parses a dtype name such as `"bf16"`, `"float32"`, `"full"` or `"half"`.

    Raises:
      ValueError: naming the unknown value and every accepted spelling.
    """
    key = name.strip().lower() if isinstance(name, str) else name
    if key == "half":
        return half_dtype()
    try:
        return NAME_TO_DTYPE[key]
    except (KeyError, TypeError):
        pass
    hint = ""
    if isinstance(key, str):
        for sep in ("_", ":", "-", " "):
            head, _, tail = key.partition(sep)
            if tail and head in POLICY_KEYS:
                hint = f" Did you mean '{head}={tail}'?"
                break
    raise ValueError(
        f"Unknown dtype {name!r}: expected one of {', '.join(ACCEPTED_DTYPE_NAMES)}."
        + hint
    )


# The keys of a policy string and the Policy field each names. `get_policy` parses with them;
# `parse_dtype` reads them to suggest the fix for a key joined to its dtype by something other
# than "=" ("compute_float16" -> "compute=float16"). Here rather than in policy.py, which
# imports this module.
POLICY_KEYS = {"p": "param", "params": "param", "c": "compute", "compute": "compute",
               "o": "output", "output": "output"}


def canonical_floating_dtype(dtype, what: str = "dtype") -> np.dtype:
    """Returns `dtype` as a numpy dtype, requiring a floating one.

    Accepts anything `jnp.dtype` accepts (jnp.float16, np.dtype, "bfloat16") and jmp's
    short names ("bf16", "f32", "half").

    Raises:
      ValueError: for a non-floating dtype or something that is not a dtype.
    """
    if isinstance(dtype, str) and dtype.strip().lower() in ACCEPTED_DTYPE_NAMES:
        return parse_dtype(dtype)
    try:
        result = np.dtype(jnp.dtype(dtype))
    except TypeError as e:
        raise ValueError(
            f"{what}={dtype!r} is not a dtype: expected a floating dtype such as "
            "jnp.float32, jnp.bfloat16 or jnp.float16."
        ) from e
    if not jnp.issubdtype(result, jnp.floating):
        raise ValueError(
            f"{what}={dtype!r} is not a floating dtype: expected one of "
            "float16, bfloat16, float32, float64."
        )
    return result


def short_name(dtype) -> str:
    """jmp's short name of a floating dtype ("f32", "bf16", ...), else its numpy name."""
    dtype = np.dtype(dtype)
    names = DTYPE_NAMES.get(dtype)
    return names[0] if names else dtype.name


__all__ = [
    "ACCEPTED_DTYPE_NAMES", "AUTOCAST_DTYPES", "BFLOAT16", "canonical_floating_dtype",
    "DTYPE_NAMES", "dtype_of", "FLOAT16", "FLOAT32", "FLOAT8_E4M3", "FLOAT8_E5M2", "FP8_DTYPES",
    "half_dtype", "HALF_DTYPES", "is_floating", "is_floating_array", "is_fp8_dtype", "is_half",
    "is_half_dtype", "is_inexact", "is_inexact_array", "is_wide", "NAME_TO_DTYPE", "parse_dtype",
    "POLICY_KEYS", "short_name"
]
