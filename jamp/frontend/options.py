"""The options of Apex's `amp.initialize`, in one object both forms of `jamp.initialize` (linen
and NNX) read: Apex's keyword names, defaults and checks, and the "Selected optimization level"
block `verbosity=1` prints."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from jamp._checks import check_bool, check_count
from jamp.policy import Properties, properties
from jamp.policy.dtypes import canonical_floating_dtype
from jamp.policy.opt_levels import OPT_LEVELS


@dataclasses.dataclass(frozen=True)
class InitializeOptions:
    """What `jamp.initialize` was asked for, beside the models and optimizers.

    Attributes:
      enabled: False returns everything unchanged (checked to be a bool on construction).
      opt_level: "O0", "O1", "O2" or "O3" (the letter O).
      cast_model_type, patch_torch_functions, keep_batchnorm_fp32, master_weights, loss_scale:
        Apex's overrides of the level's options (None keeps the level's value).
      cast_model_outputs: a dtype the models' outputs are cast to, at any level.
      num_losses: K losses, each with its own loss scale.
      verbosity: 1 prints Apex's "Selected optimization level" block; 0 is silent.
      min_loss_scale, max_loss_scale: the dynamic loss scale's floor (None: none) and ceiling.
    """

    enabled: bool = True
    opt_level: str = "O1"
    cast_model_type: Any = None
    patch_torch_functions: bool | None = None
    keep_batchnorm_fp32: Any = None
    master_weights: bool | None = None
    loss_scale: Any = None
    cast_model_outputs: Any = None
    num_losses: int = 1
    verbosity: int = 1
    min_loss_scale: float | None = None
    max_loss_scale: float = 2.0**24

    def __post_init__(self):
        object.__setattr__(self, "enabled", check_bool("enabled", self.enabled))

    def checked_counts(self) -> InitializeOptions:
        """These options with `num_losses` and `verbosity` checked and made ints. Apart from
        `enabled`, nothing is checked when `enabled=False` (Apex returns at once)."""
        return dataclasses.replace(
            self, num_losses=check_count("num_losses", self.num_losses),
            verbosity=check_count("verbosity", self.verbosity, minimum=0))

    def properties(self) -> Properties:
        """The opt level's `Properties` with the overrides applied, printed as Apex prints
        them when `verbosity` is on.

        Raises:
          RuntimeError: an unknown opt level (Apex's message).
        """
        props = properties(self.opt_level, cast_model_type=self.cast_model_type,
                           patch_torch_functions=self.patch_torch_functions,
                           keep_batchnorm_fp32=self.keep_batchnorm_fp32,
                           master_weights=self.master_weights, loss_scale=self.loss_scale)
        if self.verbosity:
            _print_options(self.opt_level, props)
        return props

    def outputs_dtype(self) -> np.dtype | None:
        """`cast_model_outputs` as a floating numpy dtype, or None.

        Raises:
          ValueError: `cast_model_outputs` is not a floating dtype.
        """
        if self.cast_model_outputs is None:
            return None
        return canonical_floating_dtype(self.cast_model_outputs, "cast_model_outputs")


def _print_options(opt_level: str, props: Properties) -> None:
    print(f"Selected optimization level {OPT_LEVELS[opt_level].brief}")
    print()
    print("Defaults for this optimization level are:")
    for name, value in properties(opt_level).options.items():
        print(f"{name:22} : {value}")
    print("Processing user overrides (additional kwargs that are not None)...")
    print("After processing overrides, optimization options are:")
    for name, value in props.options.items():
        print(f"{name:22} : {value}")


def as_list(value: Any) -> tuple[list, bool]:
    """`value` as a list (itself, when a list or tuple was given) and whether it was one, so
    that `initialize` returns lists where lists were given, as Apex does."""
    # Exactly a list or tuple: an optax GradientTransformation is a NamedTuple, not a list.
    if type(value) in (list, tuple):
        return list(value), True
    return [value], False


__all__ = ["InitializeOptions", "as_list"]
