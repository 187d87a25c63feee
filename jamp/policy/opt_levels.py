"""Apex's opt levels O0-O3 and the `Properties` that hold their seven options.

The presets are Apex's `amp/frontend.py`, with JAX dtypes in place of torch's. Overrides go
through the same consistency checks as Apex's `Properties.__setattr__`. Apex raises on a
failed check unless `hard_override` is set; jamp warns by default (an
`AmpConfigurationWarning`) and raises Apex's `RuntimeError` with `strict=True`.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import numpy as np

from jamp._checks import check_bool, parse_loss_scale
from jamp.policy.dtypes import FLOAT16, FLOAT32, canonical_floating_dtype

OPTION_NAMES = ("enabled", "opt_level", "cast_model_type", "patch_torch_functions",
                "keep_batchnorm_fp32", "master_weights", "loss_scale")


class AmpConfigurationWarning(UserWarning):
    """An opt-level override that contradicts the level it was applied to."""


@dataclasses.dataclass(frozen=True)
class OptLevel:
    """One of Apex's presets: a one-line summary and its option values."""

    name: str
    brief: str
    options: dict


OPT_LEVELS: dict[str, OptLevel] = {
    level.name: level for level in (
        OptLevel(
            "O0", "O0: Pure FP32 training.",
            dict(enabled=True, opt_level="O0", cast_model_type=FLOAT32,
                 patch_torch_functions=False, keep_batchnorm_fp32=None,
                 master_weights=False, loss_scale=1.0)),
        OptLevel(
            "O1", "O1: Insert automatic casts around JAX operations.",
            dict(enabled=True, opt_level="O1", cast_model_type=None,
                 patch_torch_functions=True, keep_batchnorm_fp32=None,
                 master_weights=None, loss_scale="dynamic")),
        OptLevel(
            "O2", "O2: FP16 training with FP32 batchnorm and FP32 master weights.",
            dict(enabled=True, opt_level="O2", cast_model_type=FLOAT16,
                 patch_torch_functions=False, keep_batchnorm_fp32=True,
                 master_weights=True, loss_scale="dynamic")),
        OptLevel(
            "O3", "O3: Pure FP16 training.",
            dict(enabled=True, opt_level="O3", cast_model_type=FLOAT16,
                 patch_torch_functions=False, keep_batchnorm_fp32=False,
                 master_weights=False, loss_scale=1.0)),
    )
}


class Properties:
    """Apex's seven amp options, readable as attributes and in `.options`.

    Every assignment after construction is checked against the current opt level, as in
    Apex. Build one with `properties(opt_level, **overrides)`.
    """

    def __init__(self, strict: bool = False):
        self.__dict__["strict"] = check_bool("strict", strict)
        self.__dict__["options"] = {
            "enabled": False,
            "opt_level": None,
            "cast_model_type": None,
            "patch_torch_functions": False,
            "keep_batchnorm_fp32": None,
            "master_weights": None,
            "loss_scale": 1.0,
        }

    def __getattr__(self, name):
        options = self.__dict__.get("options", {})
        if name in options:
            return options[name]
        raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")

    def __setattr__(self, name, value):
        if name not in self.options:
            raise AttributeError(
                f"{name!r} is not an amp option: expected one of {', '.join(OPTION_NAMES)}.")
        self.options[name] = getattr(self, f"_check_{name}", lambda v: v)(value)

    def _warn_or_err(self, message: str) -> None:
        # Apex's warn_or_err: an error unless overridden; jamp's default is the warning.
        if self.strict:
            raise RuntimeError(message)
        warnings.warn(message, AmpConfigurationWarning, stacklevel=4)

    # The flags are bools (a string such as "False" would count as true). Apex's exception,
    # kept: keep_batchnorm_fp32 also takes the strings "True" and "False".
    def _check_enabled(self, value):
        return check_bool("enabled", value)

    def _check_opt_level(self, value):
        if value not in OPT_LEVELS:
            raise _unknown_opt_level(value)
        return value

    def _check_cast_model_type(self, value):
        # Apex casts the model only where cast_model_type is truthy: None and False (its
        # multi-model tests' "do not cast") leave the model as it is.
        if _is_false(value):
            value = False
        elif value is not None:
            value = floating_option("cast_model_type", value,
                                    "False (leave the model uncast) or None (the level's "
                                    "default)")
        if self.opt_level == "O1" and value is not None and value is not False \
                and value != FLOAT32:
            self._warn_or_err(
                "O1 inserts casts around operations rather than casting model weights, so "
                "with O1 the weights themselves should stay float32. To cast the model to "
                f"another type use opt_level='O2' or 'O3'. cast_model_type was {value}.")
        return value

    def _check_patch_torch_functions(self, value):
        value = _optional_flag("patch_torch_functions", value)
        if self.opt_level != "O1" and value:
            self._warn_or_err("patch_torch_functions=True (autocast) should only be set by "
                              "selecting opt_level='O1'.")
        return value

    def _check_keep_batchnorm_fp32(self, value):
        if isinstance(value, str) and value in ("True", "False"):
            value = value == "True"
        elif value is not None and not isinstance(value, (bool, np.bool_)):
            raise ValueError(
                "keep_batchnorm_fp32 must be True, False, None or the string 'True' or "
                f"'False', found keep_batchnorm_fp32={value!r}.")
        value = None if value is None else bool(value)
        if self.opt_level == "O1" and value is not None:
            self._warn_or_err(
                "With opt_level O1, batch norm statistics already run in float32, so "
                f"keep_batchnorm_fp32 should be None. keep_batchnorm_fp32 was {value!r}.")
        return value

    def _check_master_weights(self, value):
        value = _optional_flag("master_weights", value)
        if self.opt_level == "O1" and value is not None:
            self._warn_or_err("master_weights make no sense with O1: with O1 the model "
                              "weights themselves should be float32.")
        return value

    def _check_loss_scale(self, value):
        return parse_loss_scale(value)

    def __repr__(self) -> str:
        rows = "\n".join(f"  {k:22} : {v}" for k, v in self.options.items())
        return f"Properties(\n{rows}\n)"

    def __eq__(self, other):
        return isinstance(other, Properties) and self.options == other.options

    __hash__ = None  # type: ignore[assignment]  # mutable, like Apex's


def _is_false(value: Any) -> bool:
    return isinstance(value, (bool, np.bool_)) and not value


def _optional_flag(name: str, value: Any) -> bool | None:
    """An option that is a flag or None (the level's default)."""
    if value is None:
        return None
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be True, False or None (the level's default), got "
                        f"{name}={value!r}.")
    return bool(value)


def floating_option(name: str, value: Any, others: str) -> np.dtype:
    """The dtype option `name` (`cast_model_type`, `cast_model_outputs`) as a floating numpy
    dtype.

    Args:
      name: the option, as the user wrote it.
      value: its value: a floating dtype or a name of one ("bfloat16", "bf16").
      others: the option's other accepted values, for the message.

    Raises:
      ValueError: `value` is not a floating dtype (a bool is not one, though numpy reads
        True as its bool dtype); the message names it, the dtypes and `others`.
    """
    if not isinstance(value, (bool, np.bool_)):
        try:
            return canonical_floating_dtype(value, what=name)
        except ValueError:
            pass
    raise ValueError(f"{name} must be a floating dtype (jnp.float16, jnp.bfloat16, jnp.float32 "
                     f"or a name such as 'bfloat16'), {others}, got {name}={value!r}.")


def _unknown_opt_level(value) -> RuntimeError:
    return RuntimeError(
        f"Unexpected optimization level {value!r}. Options are 'O0', 'O1', 'O2', 'O3'. "
        "Note that in `O0`, `O1`, etc., the prefix O is the letter O, not the number zero.")


def properties(opt_level: str = "O1", *, strict: bool = False, **overrides) -> Properties:
    """Apex's options for `opt_level`, with `overrides` applied through its checks.

    Args:
      opt_level: "O0", "O1", "O2" or "O3" (the letter O).
      strict: raise `RuntimeError` on an inconsistent override instead of warning.
      **overrides: any of the seven options; `None` means "keep the level's default", as in
        `apex.amp.initialize`.

    Returns:
      A `Properties` with `.options` and one attribute per option.

    Raises:
      RuntimeError: for an unknown opt level (or an inconsistent override when `strict`).
      ValueError: for an unknown option or a malformed value.
      TypeError: for `strict`, `enabled`, `patch_torch_functions` or `master_weights` given
        something other than a bool (keep_batchnorm_fp32 also takes Apex's strings "True" and
        "False").

    `cast_model_type=False` is Apex's "do not cast the model" (its multi-model tests pass it):
    kept as False, as Apex keeps it; a numpy False reads as False.

    Example:
      >>> from jamp.policy import properties
      >>> props = properties("O2", loss_scale="128.0")
      >>> props.cast_model_type, props.loss_scale
      (dtype('float16'), 128.0)
    """
    if opt_level not in OPT_LEVELS:
        raise _unknown_opt_level(opt_level)
    unknown = sorted(set(overrides) - set(OPTION_NAMES))
    if unknown:
        raise ValueError(f"Unexpected amp option(s) {', '.join(unknown)}: expected any of "
                         f"{', '.join(OPTION_NAMES)}.")
    props = Properties(strict=strict)
    # Presets bypass the checks (Apex assigns them before opt_level is final).
    props.options.update(OPT_LEVELS[opt_level].options)
    for name in OPTION_NAMES:  # Apex's order: enabled and opt_level first
        value = overrides.get(name)
        if value is not None:
            setattr(props, name, value)
    return props


__all__ = [
    "AmpConfigurationWarning", "OPT_LEVELS", "OPTION_NAMES", "OptLevel", "Properties",
    "floating_option", "properties"
]
