"""Apex's `amp.initialize` for Flax linen models and optax optimizers.

`initialize` takes what a Flax user has (the model's `apply` function, its variables and optax
transformations) and returns the same kinds, changed as Apex's opt level says:

- O0: float32 throughout (inputs cast to float32).
- O1: params float32; the apply function runs under `jamp.autocast` (float16): Apex's patched
  torch functions.
- O2: params cast to `cast_model_type` (float16) except BatchNorm's, whose params and batch
  statistics stay float32 (`keep_batchnorm_fp32`); a BatchNorm's output goes back to float16,
  as Apex's cudnn batch norm does, so every conv and matmul runs in float16; floating inputs
  are cast to float16; the optimizers keep float32 master weights.
- O3: everything float16 (BatchNorm too, unless `keep_batchnorm_fp32=True`).

Where the model is cast (O0, O2, O3: `cast_model_type` neither None nor False), its floating
outputs are cast to float32, as Apex's patched forward does, so the loss never runs on half
logits; `cast_model_outputs` picks another dtype, at any level.

Every returned optimizer is `jamp.loss_scaled(...)` (a static scale of 1.0 at O0 and O3).

BatchNorm layers are found from the variables' structure: a module that keeps running
statistics (a `batch_stats` entry) is a batch norm; at run time the layers cast back to half
are those that are instances of `flax.linen.BatchNorm`.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jamp.frontend.casts import cast_floating, check_float32
from jamp.frontend.nnx_initialization import initialize_nnx
from jamp.frontend.optimizers import amp_optimizer, as_transformation, param_dtypes
from jamp.frontend.options import InitializeOptions, as_list, model_dtype
from jamp.policy import Properties
from jamp.policy.dtypes import is_inexact_array
from jamp.transforms import autocast

_BATCH_STATS = "batch_stats"


def initialize(
    apply_fns: Any,
    variables: Any = None,
    txs: Any = None,
    enabled: bool = True,
    opt_level: str = "O1",
    cast_model_type: Any = None,
    patch_torch_functions: bool | None = None,
    keep_batchnorm_fp32: Any = None,
    master_weights: bool | None = None,
    loss_scale: Any = None,
    cast_model_outputs: Any = None,
    num_losses: int = 1,
    verbosity: int = 1,
    min_loss_scale: float | None = None,
    max_loss_scale: float = 2.0**24,
):
    """Sets up Flax models and optax optimizers for mixed precision at an Apex opt level.

    With Flax NNX, pass the `nnx.Module` (or a list) and its `nnx.Optimizer` (or a list)
    instead: they are set up in place and returned (see `initialize_nnx`, docs/apex.md).

    Args:
      apply_fns: a linen model's `apply` (`model.apply`), or a list of them.
      variables: the model's variables (`model.init(...)`), or a list, one per model.
      txs: an optax transformation (or `optax.MultiSteps`) or a list of them (None for
        inference).
      enabled: False returns everything unchanged.
      opt_level: "O0", "O1", "O2" or "O3" (the letter O).
      cast_model_type, patch_torch_functions, keep_batchnorm_fp32, master_weights, loss_scale:
        Apex's overrides of the level's options (None keeps the level's value).
      cast_model_outputs: a dtype the apply functions' floating outputs are cast to, at any
        level. None: float32 where the model is cast (O0, O2, O3), as in Apex.
      num_losses: K losses, each with its own loss scale (`jamp.scale_loss(..., loss_id=k)`;
        `update` then takes a sequence of K grad trees).
      verbosity: 1 prints Apex's "Selected optimization level" block; 0 is silent.
      min_loss_scale, max_loss_scale: the dynamic loss scale's floor (None: none) and ceiling.

    Returns:
      `(apply_fns, variables)` or `(apply_fns, variables, txs)`, each a list where it was given
      as one. Initialize the returned optimizers with the returned params:
      `opt_state = tx.init(variables["params"])`.

    Raises:
      RuntimeError: an unknown opt level (Apex's message), an inconsistent override with
        `properties(strict=True)` semantics (here a warning), or a second pass: an apply
        function or optimizer that `initialize` returned, or an optimizer made by
        `jamp.loss_scaled` (Apex: "should only be passed through amp.initialize once").
      TypeError: an apply function that is not a linen model's `apply`, an optimizer that is
        not an optax transformation, or flags of the wrong type.
      ValueError: lists of different lengths, floating variables that are not float32 (Apex's
        float32 check: half variables are what `initialize` returns), `keep_batchnorm_fp32`
        given for a model without BatchNorm, or a bad loss-scale setting.

    Example:
      >>> import jax, jax.numpy as jnp, optax, flax.linen as nn, jamp
      >>> model = nn.Dense(4)
      >>> variables = model.init(jax.random.key(0), jnp.ones((2, 3)))
      >>> apply_fn, variables, tx = jamp.initialize(
      ...     model.apply, variables, optax.adam(1e-3), opt_level="O2", verbosity=0)
      >>> variables["params"]["kernel"].dtype, apply_fn(variables, jnp.ones((2, 3))).dtype
      (dtype('float16'), dtype('float32'))
      >>> opt_state = tx.init(variables["params"])
      >>> jamp.master_params(opt_state)["kernel"].dtype
      dtype('float32')
    """
    options = InitializeOptions(
        enabled=enabled, opt_level=opt_level, cast_model_type=cast_model_type,
        patch_torch_functions=patch_torch_functions, keep_batchnorm_fp32=keep_batchnorm_fp32,
        master_weights=master_weights, loss_scale=loss_scale,
        cast_model_outputs=cast_model_outputs, num_losses=num_losses, verbosity=verbosity,
        min_loss_scale=min_loss_scale, max_loss_scale=max_loss_scale)
    if _is_nnx(apply_fns):
        return initialize_nnx(apply_fns, variables, options)
    return _initialize_linen(apply_fns, variables, txs, options)


def _initialize_linen(apply_fns: Any, variables: Any, txs: Any, options: InitializeOptions):
    """The linen form of `initialize`: new apply functions, variables and optimizers."""
    fns, fns_listed = as_list(apply_fns)
    all_variables, variables_listed = as_list(variables)
    if len(all_variables) != len(fns):
        raise ValueError(f"initialize got {len(fns)} apply function(s) but {len(all_variables)} "
                         f"set(s) of variables: give one variables dict per model.")
    tx_list, txs_listed = ([], False) if txs is None else as_list(txs)
    if not options.enabled:
        return (apply_fns, variables) if txs is None else (apply_fns, variables, txs)
    options = options.checked_counts()
    for i, fn in enumerate(fns):
        _check_flax_apply(fn, i if fns_listed else None)
    # A second pass shows first in the optimizers (the variables it returned are half at O2).
    tx_list = [as_transformation(tx, f"txs[{i}]" if txs_listed else "txs")
               for i, tx in enumerate(tx_list)]
    for i, v in enumerate(all_variables):
        _check_variables(v, i if variables_listed else None)

    props = options.properties()
    if options.keep_batchnorm_fp32 is not None:
        for i, v in enumerate(all_variables):
            if not batch_norm_paths(v):
                where = f"model {i}" if fns_listed else "the model"
                raise ValueError(
                    f"keep_batchnorm_fp32={options.keep_batchnorm_fp32!r} was given, but "
                    f"{where} has no BatchNorm layer (no module keeps batch_stats): leave it "
                    f"None.")
    dtype = model_dtype(props)
    outputs_dtype = options.outputs_dtype(dtype)

    keep_bn = bool(props.keep_batchnorm_fp32) if dtype is not None else True
    new_variables = [cast_model(v, dtype, keep_bn) if dtype is not None else v
                     for v in all_variables]
    new_fns = [_amp_apply(fn, props, dtype, outputs_dtype) for fn in fns]
    allowed = param_dtypes(dtype, keep_bn)
    returned_params = [v["params"] for v in new_variables]
    new_txs = [amp_optimizer(tx, props, options.num_losses, options.min_loss_scale,
                             options.max_loss_scale, allowed, returned_params)
               for tx in tx_list]

    out_fns = new_fns if fns_listed else new_fns[0]
    out_vars = new_variables if variables_listed else new_variables[0]
    if txs is None:
        return out_fns, out_vars
    return out_fns, out_vars, new_txs if txs_listed else new_txs[0]


def _is_nnx(models: Any) -> bool:
    """True for an `nnx.Module` or a list of them (the NNX form of `initialize`)."""
    first = models[0] if type(models) in (list, tuple) and models else models
    return isinstance(first, nnx.Module)


def _check_flax_apply(fn: Any, index: int | None) -> None:
    where = "apply_fns" if index is None else f"apply_fns[{index}]"
    props = getattr(fn, "amp_properties", None)
    if isinstance(props, Properties):
        raise RuntimeError(
            f"{where} was returned by jamp.initialize (opt level {props.opt_level}): a model is "
            f"passed through initialize once, and this apply function is set up already. Keep "
            f"using it, or, to set the model up again (at another level), give initialize the "
            f"model's own apply (model.apply) with its float32 variables.")
    module = getattr(fn, "__self__", None)
    if not (callable(fn) and isinstance(module, nn.Module)
            and getattr(fn, "__name__", "") == "apply"):
        raise TypeError(
            f"{where} must be a Flax linen model's apply function (`model.apply`), got "
            f"{fn!r}. For an NNX model, pass the nnx.Module itself (and nnx.Optimizers).")


def _check_variables(variables: Any, index: int | None) -> None:
    where = "variables" if index is None else f"variables[{index}]"
    if not (hasattr(variables, "get") and "params" in variables):
        raise TypeError(f"{where} must be a Flax variables dict with a 'params' collection "
                        f"(what model.init returns), got {type(variables).__name__}.")
    for path, leaf in jax.tree_util.tree_leaves_with_path(variables):
        if is_inexact_array(leaf):
            check_float32(f"{where}{jax.tree_util.keystr(path)}", leaf.dtype)


# --- the model's variables --------------------------------------------------------------------


def batch_norm_paths(variables: Any) -> set[tuple]:
    """The module paths (tuples of keys) of the batch norms in `variables`: the modules that
    keep running statistics in the `batch_stats` collection."""
    stats = variables.get(_BATCH_STATS) if hasattr(variables, "get") else None
    if not stats:
        return set()
    paths = set()
    for path, _ in jax.tree_util.tree_leaves_with_path(stats):
        paths.add(tuple(_key(k) for k in path[:-1]))
    return paths


def _key(entry) -> Any:
    return getattr(entry, "key", getattr(entry, "name", getattr(entry, "idx", entry)))


def _under(path: tuple, prefixes: set[tuple]) -> bool:
    return any(path[:len(p)] == p for p in prefixes)


def cast_model(variables: Any, dtype: Any, keep_batchnorm_fp32: bool) -> Any:
    """`variables` with params (and batch statistics) cast to `dtype`, Apex's model cast.

    With `keep_batchnorm_fp32`, the params of batch norms and the batch statistics stay
    float32. Other collections are left as they are.
    """
    dtype = np.dtype(dtype)
    norms = batch_norm_paths(variables)

    def cast_params(path, leaf):
        keys = tuple(_key(k) for k in path)
        if (not is_inexact_array(leaf, python_scalars=True)
                or (keep_batchnorm_fp32 and _under(keys[:-1], norms))):
            return leaf
        return jnp.asarray(leaf).astype(dtype)

    out = dict(variables)
    out["params"] = jax.tree_util.tree_map_with_path(cast_params, variables["params"])
    if _BATCH_STATS in variables and not keep_batchnorm_fp32:
        out[_BATCH_STATS] = jax.tree_util.tree_map(
            lambda x: (jnp.asarray(x).astype(dtype) if is_inexact_array(x, python_scalars=True)
                       else x),
            variables[_BATCH_STATS])
    return type(variables)(out) if not isinstance(variables, dict) else out


# --- the apply function -----------------------------------------------------------------------


def _amp_apply(fn: Callable, props, dtype, outputs_dtype) -> Callable:
    """`fn` with Apex's patched forward: inputs cast to the model's `dtype` (None: not cast),
    outputs to `outputs_dtype` (None: as `fn` returns them), under autocast at O1."""
    run = autocast(fn, dtype=jnp.float16) if props.patch_torch_functions else fn

    @functools.wraps(fn)
    def amp_apply(variables, *args, **kwargs):
        if dtype is not None:
            args, kwargs = cast_floating((args, kwargs), dtype)
            with nn.intercept_methods(_batch_norm_output_to(dtype)):
                out = run(variables, *args, **kwargs)
        else:
            out = run(variables, *args, **kwargs)
        if kwargs.get("mutable"):
            out, updates = out
            updates = _keep_dtypes(updates, variables)
            return cast_floating(out, outputs_dtype), updates
        return cast_floating(out, outputs_dtype)

    # How a second initialize knows the function is one it returned (see _check_flax_apply).
    amp_apply.amp_properties = props  # type: ignore[attr-defined]  # a mark, set on purpose
    return amp_apply


def _batch_norm_output_to(dtype):
    """An interceptor casting what a BatchNorm's `__call__` returns to `dtype` (the output of
    a float32 batch norm goes back to the model's half type, as in Apex)."""

    def interceptor(next_fun, args, kwargs, context):
        out = next_fun(*args, **kwargs)
        if isinstance(context.module, nn.BatchNorm) and context.method_name == "__call__":
            return cast_floating(out, dtype)
        return out

    return interceptor


def _keep_dtypes(updates: Any, variables: Any) -> Any:
    """Mutated collections (batch statistics) in the dtypes they came in with, so a training
    step returns the state types it was given."""
    def keep(path, new):
        old = _lookup(variables, path)
        if (old is not None and is_inexact_array(new, python_scalars=True)
                and hasattr(old, "dtype")):
            return jnp.asarray(new).astype(old.dtype)
        return new

    return jax.tree_util.tree_map_with_path(keep, updates)


def _lookup(tree, path):
    for entry in path:
        key = _key(entry)
        if not hasattr(tree, "get") or key not in tree:
            return None
        tree = tree[key]
    return tree


__all__ = ["batch_norm_paths", "cast_model", "initialize"]
