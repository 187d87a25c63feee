"""The options of Apex's `amp.initialize`, in one object both forms of `jamp.initialize` (linen
and NNX) read: Apex's keyword names, defaults and checks, and the "Selected optimization level"
block `verbosity=1` prints."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from jamp._checks import check_bool, check_count
from jamp.policy import Properties, properties
from jamp.policy.dtypes import FLOAT32
from jamp.policy.opt_levels import OPT_LEVELS, floating_option


@dataclasses.dataclass(frozen=True)
class InitializeOptions:
    """What `jamp.initialize` was asked for, beside the models and optimizers.

    Attributes:
      enabled: False returns everything unchanged (checked to be a bool on construction).
      opt_level: "O0", "O1", "O2" or "O3" (the letter O).
      cast_model_type, patch_torch_functions, keep_batchnorm_fp32, master_weights, loss_scale:
        Apex's overrides of the level's options (None keeps the level's value).
      cast_model_outputs: a dtype the models' floating outputs are cast to, at any level
        (None: float32 where the model is cast, as in Apex).
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

    def outputs_dtype(self, model_dtype: np.dtype | None) -> np.dtype | None:
        """The dtype the models' floating outputs are cast to, Apex's rule: `cast_model_outputs`
        where given (at any level), else float32 where the model is cast (`model_dtype` not
        None: Apex's patched forward returns float32, so the loss never runs on half logits),
        else None (the outputs as the model returns them).

        Raises:
          ValueError: `cast_model_outputs` is not a floating dtype.
        """
        if self.cast_model_outputs is not None:
            return floating_option("cast_model_outputs", self.cast_model_outputs,
                                   "or None (float32 where the model is cast, else the outputs "
                                   "as the model returns them)")
        return None if model_dtype is None else FLOAT32


def model_dtype(props: Properties) -> np.dtype | None:
    """The dtype the models are cast to (with their floating inputs), or None where they are
    left as they are: Apex casts where `cast_model_type` is truthy, so None and False (its "do
    not cast") both leave the model uncast."""
    dtype = props.cast_model_type
    return None if dtype is None or dtype is False else np.dtype(dtype)


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


__all__ = ["InitializeOptions", "as_list", "model_dtype"]
