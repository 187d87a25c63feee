"""fp8 recipes: which float8 dtype and which scaling each operand of the three GEMMs of a
linear layer takes, as torchao's `Float8LinearConfig.from_recipe_name` and Transformer Engine's
recipes define them.

A linear layer's training step runs three GEMMs (named here by `jax.lax.dot_general`'s
operands, `lhs` the input and `rhs` the weight):

- output:   `out = lhs . rhs`
- grad_lhs: `d lhs = d out . rhs`   (torchao's grad_input)
- grad_rhs: `d rhs = lhs . d out`   (torchao's grad_weight)

A `Recipe` names, for each GEMM and each of its two operands, a `Cast`: the float8 dtype (or
None: kept in high precision) and the scaling granularity. A recipe is a frozen, hashable
dataclass, so it is a static argument under `jax.jit` and a value a precision rule can hold.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, NamedTuple

import numpy as np

from jamp._checks import check_bool, check_count, check_positive
from jamp.policy.dtypes import FLOAT8_E4M3, FLOAT8_E5M2, is_fp8_dtype

Granularity = Literal["tensor", "row", "block"]
Scaling = Literal["current", "delayed", "block"]


@dataclasses.dataclass(frozen=True)
class Cast:
    """How one GEMM operand is cast.

    Attributes:
      dtype: the float8 dtype, or None for an operand kept in high precision.
      granularity: "tensor" (one scale per tensor), "row" (one scale per row: along the GEMM's
        contracting dimensions) or "block" (one power-of-two scale per 32 elements along them).
    """

    dtype: np.dtype | None
    granularity: Granularity = "tensor"


class Gemm(NamedTuple):
    """The casts of one GEMM's two operands, in `dot_general`'s order."""

    lhs: Cast
    rhs: Cast


class Gemms(NamedTuple):
    """The casts of a linear layer's three GEMMs (see the module docstring)."""

    output: Gemm
    grad_lhs: Gemm
    grad_rhs: Gemm


_E4M3_TENSOR = Cast(FLOAT8_E4M3)
_E5M2_TENSOR = Cast(FLOAT8_E5M2)
_E4M3_ROW = Cast(FLOAT8_E4M3, "row")
_E4M3_BLOCK = Cast(FLOAT8_E4M3, "block")
_HIGH = Cast(None)
# Per tensor, e4m3 forward and e5m2 for the output gradient: torchao's tensorwise and the
# delayed recipe of Transformer Engine and Flax (TE's HYBRID format).
_HYBRID_TENSORWISE = Gemms(Gemm(_E4M3_TENSOR, _E4M3_TENSOR), Gemm(_E5M2_TENSOR, _E4M3_TENSOR),
                           Gemm(_E4M3_TENSOR, _E5M2_TENSOR))


class _Definition(NamedTuple):
    scaling: Scaling
    gemms: Gemms
    defaults: dict[str, Any]


# The one table of recipes: each name's scaling, casts and options with their defaults.
_RECIPES: dict[str, _Definition] = {
    "tensorwise": _Definition("current", _HYBRID_TENSORWISE,
                              {"round_scales_to_power_of_2": False}),
    "rowwise": _Definition("current", Gemms(Gemm(_E4M3_ROW, _E4M3_ROW),
                                            Gemm(_E4M3_ROW, _E4M3_ROW),
                                            Gemm(_E4M3_ROW, _E4M3_ROW)),
                           {"round_scales_to_power_of_2": True}),
    # torchao's choice: the weight of grad_lhs is cast per tensor, and grad_rhs runs on the
    # high-precision input and output gradient.
    "rowwise_with_gw_hp": _Definition("current", Gemms(Gemm(_E4M3_ROW, _E4M3_ROW),
                                                       Gemm(_E4M3_ROW, _E4M3_TENSOR),
                                                       Gemm(_HIGH, _HIGH)),
                                      {"round_scales_to_power_of_2": True}),
    "delayed": _Definition("delayed", _HYBRID_TENSORWISE,
                           {"amax_history_length": 1024, "amax_compute_algo": "max",
                            "margin": 0}),
    "mxfp8": _Definition("block", Gemms(Gemm(_E4M3_BLOCK, _E4M3_BLOCK),
                                        Gemm(_E4M3_BLOCK, _E4M3_BLOCK),
                                        Gemm(_E4M3_BLOCK, _E4M3_BLOCK)), {}),
}
RECIPE_NAMES: tuple[str, ...] = tuple(_RECIPES)
AMAX_COMPUTE_ALGOS = ("max", "most_recent")
# The block size of the MX formats (OCP Microscaling spec): one e8m0 scale per 32 elements.
MX_BLOCK_SIZE = 32


@dataclasses.dataclass(frozen=True)
class Recipe:
    """An fp8 recipe: make one with `jamp.fp8.recipe(name, **options)`.

    Attributes:
      name: one of `RECIPE_NAMES`.
      options: the recipe's options, every one with its value (defaults filled in), as sorted
        `(name, value)` pairs so the recipe hashes.
    """

    name: str
    options: tuple[tuple[str, Any], ...] = ()

    @property
    def scaling(self) -> Scaling:
        """"current" (scales from the tensor itself), "delayed" (from an amax history) or
        "block" (mxfp8's per-block scales)."""
        return _RECIPES[self.name].scaling

    @property
    def gemms(self) -> Gemms:
        """The casts of the three GEMMs."""
        return _RECIPES[self.name].gemms

    def option(self, name: str) -> Any:
        """The value of option `name` (its default when not given)."""
        return dict(self.options)[name]

    def __repr__(self) -> str:
        defaults = _RECIPES[self.name].defaults
        given = "".join(f", {k}={v!r}" for k, v in self.options if v != defaults[k])
        return f"jamp.fp8.recipe({self.name!r}{given})"


def recipe(name: str, **options: Any) -> Recipe:
    """The fp8 recipe `name` with `options`.

    Names and options (defaults in brackets):

    - "tensorwise": torchao's default; e4m3 input and weight, e5m2 output gradient, one scale
      per tensor. `round_scales_to_power_of_2` [False].
    - "rowwise": e4m3 everywhere, one scale per row along each GEMM's contracting dimensions.
      `round_scales_to_power_of_2` [True].
    - "rowwise_with_gw_hp": rowwise, with the weight gradient GEMM in high precision.
      `round_scales_to_power_of_2` [True].
    - "delayed": Transformer Engine / Flax delayed scaling, per-tensor scales from an amax
      history. `amax_history_length` [1024], `amax_compute_algo` ["max" or "most_recent"],
      `margin` [0].
    - "mxfp8": e4m3 with one power-of-two (e8m0) scale per 32 elements along the contracting
      dimensions. No options.

    Raises:
      ValueError: for an unknown name or an option value out of range.
      TypeError: for an option the recipe does not take.

    >>> import jamp
    >>> jamp.fp8.recipe("delayed", amax_history_length=16)
    jamp.fp8.recipe('delayed', amax_history_length=16)
    """
    if name not in _RECIPES:
        raise ValueError(f"Unknown fp8 recipe {name!r}: expected one of "
                         f"{', '.join(map(repr, RECIPE_NAMES))}.")
    defaults = _RECIPES[name].defaults
    for key in options:
        if key not in defaults:
            accepted = ", ".join(defaults) if defaults else "none"
            raise TypeError(f"fp8 recipe {name!r} got an unexpected option {key!r}: its "
                            f"options are {accepted}.")
    values = {**defaults, **options}
    if "round_scales_to_power_of_2" in values:
        check_bool("round_scales_to_power_of_2", values["round_scales_to_power_of_2"])
    if "amax_history_length" in values:
        values["amax_history_length"] = check_count("amax_history_length",
                                                    values["amax_history_length"])
    if "amax_compute_algo" in values and values["amax_compute_algo"] not in AMAX_COMPUTE_ALGOS:
        raise ValueError(f"Unknown amax_compute_algo={values['amax_compute_algo']!r}: expected "
                         f"one of {', '.join(map(repr, AMAX_COMPUTE_ALGOS))}.")
    if "margin" in values:
        check_positive("margin", values["margin"], allow_zero=True)
    return Recipe(name, tuple(sorted(values.items())))


def check_recipe(value: Any, what: str = "recipe") -> Recipe:
    """`value` if it is a `Recipe`; else a TypeError that says how to write one.

    Where a precision rule or autocast is given a float8 dtype (`jnp.float8_e4m3fn`) or a
    recipe's name as a string, the message shows the `jamp.fp8.recipe(...)` call to write.
    """
    if isinstance(value, Recipe):
        return value
    if is_fp8_dtype(value):
        raise TypeError(
            f"{what}={np.dtype(value).name} is a float8 dtype, not an fp8 recipe: float8 "
            "training needs scales as well as a dtype. Write jamp.fp8.recipe(\"tensorwise\") "
            f"(or one of {', '.join(map(repr, RECIPE_NAMES))}).")
    if isinstance(value, str) and value in _RECIPES:
        raise TypeError(f"{what}={value!r} is a recipe's name: write "
                        f"jamp.fp8.recipe({value!r}).")
    raise TypeError(f"{what}={value!r} is not an fp8 recipe: write jamp.fp8.recipe(name) with "
                    f"name one of {', '.join(map(repr, RECIPE_NAMES))}.")


__all__ = ["AMAX_COMPUTE_ALGOS", "Cast", "check_recipe", "Gemm", "Gemms", "Granularity",
           "MX_BLOCK_SIZE", "Recipe", "recipe", "RECIPE_NAMES", "Scaling"]
