"""fp8 training: float8 GEMMs with torchao's recipes, Transformer Engine / Flax delayed
scaling and mxfp8 block scaling (see docs/fp8.md).

- `recipe(name, **options)`: a hashable `Recipe` ("tensorwise", "rowwise",
  "rowwise_with_gw_hp", "delayed", "mxfp8"); `check_recipe(value)` for where one is expected.
- `dot_general(lhs, rhs, dimension_numbers, recipe, *, state=None, ...)`: `lax.dot_general`
  whose forward and both gradient GEMMs run on float8 operands with a float32 accumulator;
  `conv_general_dilated(..., recipe=...)` the same for `lax.conv_general_dilated`.
- `saturating_cast(x, dtype)`: a cast to float8 that clamps instead of overflowing.
- Delayed scaling: `DelayedState`, `init_delayed_state(recipe)`, `scale_from_history`,
  `update_amax_history`; the next state is the gradient with respect to the state. Under
  autocast: `init_autocast_state(fn, *args)` and `with_state(fn)(state, *args)`.
"""

from jamp.fp8 import autocast_state, casts, delayed_scaling, gemm, products, recipes
from jamp.fp8.autocast_state import init_autocast_state, with_state
from jamp.fp8.casts import amax_to_scale, saturating_cast
from jamp.fp8.delayed_scaling import (
    DelayedState,
    init_delayed_state,
    scale_from_history,
    update_amax_history,
)
from jamp.fp8.gemm import conv_general_dilated, dot_general
from jamp.fp8.recipes import RECIPE_NAMES, Cast, Recipe, check_recipe, recipe

__all__ = ["amax_to_scale", "autocast_state", "Cast", "casts", "check_recipe",
           "conv_general_dilated", "DelayedState", "delayed_scaling", "dot_general", "gemm",
           "init_autocast_state", "init_delayed_state", "products", "recipe", "RECIPE_NAMES",
           "Recipe", "recipes", "saturating_cast", "scale_from_history", "update_amax_history",
           "with_state"]
