"""jamp: automatic mixed precision for JAX, Flax and optax.

The public face: names promised to users are re-exported here; nothing is defined here.
"""

from jamp import policy
from jamp.policy import (
    Policy,
    Properties,
    cast_to_full,
    cast_to_half,
    get_policy,
    half_dtype,
    properties,
)

__version__ = "0.1.0"
