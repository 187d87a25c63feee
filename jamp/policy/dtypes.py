"""Dtype names and parsing shared by policies, opt levels and autocast.

jmp's spellings are the reference: `full`/`f32`/`float32`, `half`, `f16`/`float16`,
`bf16`/`bfloat16`, `f64`/`float64`. jamp also accepts torch's `fp16`/`fp32`/`fp64`.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np



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
