"""Dtypes and policies: jmp's `Policy`, pytree casts, and Apex's opt levels.

`import jamp.policy as jmp` runs code written against jmp's policy API.
"""

from jamp.policy.cast import cast_floating, cast_to_full, cast_to_half, is_floating_array
from jamp.policy.dtypes import half_dtype, parse_dtype
from jamp.policy.opt_levels import (
    OPT_LEVELS,
    AmpConfigurationWarning,
    OptLevel,
    Properties,
    properties,
)
from jamp.policy.policy import Policy, get_policy

__all__ = [
    "AmpConfigurationWarning", "OPT_LEVELS", "OptLevel", "Policy", "Properties",
    "cast_floating", "cast_to_full", "cast_to_half", "get_policy", "half_dtype",
    "is_floating_array", "parse_dtype", "properties",
]
