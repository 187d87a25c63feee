"""Dtypes and policies: jmp's `Policy`, pytree casts, Apex's opt levels, and autocast's op
tables (`OpTable`, `autocast_table`, `DEFAULT_TABLES` and the rules `LOWER`, `FP32`,
`ACCUMULATE_FP32`, `FP32_STATISTICS`).

`import jamp.policy as jmp` runs code written against jmp's policy API.

`policy` is at the bottom of jamp's dependencies: of jamp it imports only the leaf modules
that import nothing else of jamp, `_checks` (argument checks), `_jax_internals` (JAX's call
primitives) and `walker.walk` (the walk over a jaxpr's equations).
"""

from jamp.policy.autocast_tables import (
    ACCUMULATE_FP32,
    DEFAULT_TABLES,
    FP32,
    FP32_STATISTICS,
    LOWER,
    OpTable,
    autocast_table,
)
from jamp.policy.cast import cast_floating, cast_to_full, cast_to_half
from jamp.policy.dtypes import DTYPE_NAMES as dtype_to_names
from jamp.policy.dtypes import NAME_TO_DTYPE as name_to_dtype
from jamp.policy.dtypes import half_dtype, is_floating_array, parse_dtype
from jamp.policy.opt_levels import (
    OPT_LEVELS,
    AmpConfigurationWarning,
    OptLevel,
    Properties,
    properties,
)
from jamp.policy.policy import Policy, get_policy
from jamp.policy.primitives import primitive_names

__all__ = [
    "ACCUMULATE_FP32", "DEFAULT_TABLES", "FP32", "FP32_STATISTICS", "LOWER", "OpTable",
    "autocast_table",
    "AmpConfigurationWarning", "OPT_LEVELS", "OptLevel", "Policy", "Properties",
    "cast_floating", "cast_to_full", "cast_to_half", "dtype_to_names", "get_policy", "half_dtype",
    "is_floating_array", "name_to_dtype", "parse_dtype", "primitive_names", "properties",
]
