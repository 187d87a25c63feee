"""jmp's `Policy` and `get_policy`: the three dtypes of a mixed-precision model.

Same signatures and semantics as jmp, so `import jamp.policy as jmp` runs jmp code.
"""

from __future__ import annotations

import dataclasses
from typing import TypeVar

import numpy as np

from jamp.policy.cast import cast_floating
from jamp.policy.dtypes import (
    FLOAT32,
    POLICY_KEYS,
    canonical_floating_dtype,
    parse_dtype,
    short_name,
)

T = TypeVar("T")

@dataclasses.dataclass(frozen=True)
class Policy:
    """Which dtype parameters are stored in, computations run in, and outputs are returned in.

    Frozen and hashable, so it can be a static argument of `jax.jit` or a Flax module field.
    The dtypes are stored as `numpy.dtype` objects, which compare equal to `jnp.float32`,
    `np.float32` and `"float32"` alike.

    Example:
      >>> import jax.numpy as jnp
      >>> from jamp.policy import Policy
      >>> policy = Policy(jnp.float32, jnp.bfloat16, jnp.float32)
      >>> params = policy.cast_to_param({"w": jnp.ones((2, 2))})
      >>> y = policy.cast_to_compute(jnp.ones((3, 2))) @ policy.cast_to_compute(params["w"])
      >>> y.dtype, policy.cast_to_output(y).dtype
      (dtype(bfloat16), dtype('float32'))
    """

    param_dtype: np.dtype
    compute_dtype: np.dtype
    output_dtype: np.dtype

    def __post_init__(self):
        for field in ("param_dtype", "compute_dtype", "output_dtype"):
            value = canonical_floating_dtype(getattr(self, field), what=field)
            object.__setattr__(self, field, value)

    def cast_to_param(self, x: T) -> T:
        """Casts the floating leaves of `x` to `param_dtype`."""
        return cast_floating(x, self.param_dtype)

    def cast_to_compute(self, x: T) -> T:
        """Casts the floating leaves of `x` to `compute_dtype`."""
        return cast_floating(x, self.compute_dtype)

    def cast_to_output(self, x: T) -> T:
        """Casts the floating leaves of `x` to `output_dtype`."""
        return cast_floating(x, self.output_dtype)

    def with_output_dtype(self, output_dtype) -> "Policy":
        """A copy of this policy with another `output_dtype`."""
        return dataclasses.replace(self, output_dtype=output_dtype)

    def __str__(self) -> str:
        return "p={},c={},o={}".format(
            short_name(self.param_dtype), short_name(self.compute_dtype),
            short_name(self.output_dtype))


def get_policy(policy_name: str | Policy) -> Policy:
    """Parses a policy string, jmp's grammar.

    Accepted forms:
      * a dtype for all three: `"float32"`, `"f32"`, `"full"`, `"half"`, `"bf16"`;
      * `key=dtype` pairs, comma separated, keys `p`/`params`, `c`/`compute`,
        `o`/`output`: `"params=float32,compute=bfloat16,output=float32"` or `"p=f32,c=bf16"`.
        Params default to float32, compute follows params and output follows compute, so
        `"c=f16"` is `p=f32,c=f16,o=f16`.

    Case and surrounding spaces are ignored. A `Policy` is returned as is.

    Raises:
      ValueError: naming the unknown key or dtype and the accepted spellings.
    """
    if isinstance(policy_name, Policy):
        return policy_name
    if not isinstance(policy_name, str):
        raise ValueError(f"get_policy expects a policy string, got {policy_name!r}.")
    if "=" not in policy_name:
        dtype = parse_dtype(policy_name)
        return Policy(dtype, dtype, dtype)

    chosen: dict[str, np.dtype] = {}
    for part in policy_name.split(","):
        key, sep, value = part.partition("=")
        key = key.strip().lower()
        if not sep or key not in POLICY_KEYS:
            raise ValueError(
                f"Unknown key {key!r} in policy {policy_name!r}: expected "
                "'params' (or 'p'), 'compute' (or 'c') or 'output' (or 'o'), "
                "as in 'params=float32,compute=bfloat16,output=float32'.")
        field = POLICY_KEYS[key]
        if field in chosen:
            raise ValueError(f"{field} is given twice in policy {policy_name!r}.")
        chosen[field] = parse_dtype(value)

    param = chosen.get("param", FLOAT32)
    compute = chosen.get("compute", param)
    output = chosen.get("output", compute)
    return Policy(param, compute, output)


__all__ = ["get_policy", "Policy"]
