"""Apex's `amp.initialize` for Flax NNX: `jamp.initialize(model, optimizer, opt_level="O2")`.

The NNX form takes what an NNX user has, an `nnx.Module` and an `nnx.Optimizer` (or lists of
them), and sets them up at Apex's opt level (the options, defaults and overrides are those of
the linen form, read from one `jamp.frontend.options.InitializeOptions`):

- O0: float32 throughout (params cast to float32, floating inputs cast to float32).
- O1: params float32; the model's `__call__` runs under `jamp.autocast(dtype=float16)`.
- O2: `nnx.Param` values cast to `cast_model_type` (float16) except those of batch norms,
  whose params and `nnx.BatchStat` running statistics stay float32 (`keep_batchnorm_fp32`);
  a batch norm's output goes back to float16 (as Apex's cudnn batch norm does), so every
  conv and matmul runs in float16; floating inputs are cast to float16; the optimizer keeps
  float32 master weights.
- O3: everything float16 (batch norms too, unless `keep_batchnorm_fp32=True`).

Where the model is cast, its floating outputs come back in float32 (or `cast_model_outputs`),
as in the linen form and Apex.

Every optimizer's transformation becomes `jamp.loss_scaled(...)` of the user's (with
`jamp.master_weights` around it when the level keeps masters): the same
`jamp.frontend.optimizers.amp_optimizer` the linen form returns.

**In place, as Apex.** NNX models and optimizers are mutable objects that other code holds
references to (a training loop, a checkpoint manager, an `nnx.Optimizer` made for the model),
and Apex itself changes the models and optimizers it is given and returns them. So
`initialize` changes the objects it is given and returns those same objects (in Apex's
structure: lists where lists were given, the model(s) alone when no optimizer is given):

- the model's floating `nnx.Param` (and, without `keep_batchnorm_fp32`, `nnx.BatchStat`)
  Variables are cast in place (the same Variable objects, new values). Half batch
  statistics (O3) get an `on_set_value` hook, NNX's own mechanism for this, that stores what
  BatchNorm writes (running averages it computes in float32) in their half type;
- the model's class becomes a subclass of its class made by jamp (same name, `isinstance`
  still holds, state paths unchanged), whose `__call__` casts the floating inputs (NNX
  objects passed in, such as an `nnx.Rngs`, are left as they are: they are the caller's),
  runs the original `__call__` (under autocast at O1), keeps every floating Variable in the
  dtype it had before the call, as the linen form keeps mutated collections, and casts the
  outputs (float32 where the model is cast, or `cast_model_outputs`). Python looks a special
  method up on the class, so this is how an object's `__call__` can change; the class is
  part of the model's graph definition, so `nnx.split`/`nnx.merge`, `nnx.jit`,
  `nnx.value_and_grad`, `nnx.clone`, `copy.deepcopy` and pickle carry it along. Only
  `__call__` is wrapped, as Apex patches only `forward`;
- where a float32 batch norm's output must go back to half (O2), each batch norm's class is
  swapped the same way for one whose `__call__` casts its floating outputs;
- the optimizer's `tx` becomes jamp's and its `opt_state` is made again from the cast model
  (`nnx.Optimizer`'s own `to_opt_state(tx.init(nnx.state(model, wrt)))`), so
  `optimizer.update(model, grads)` (with `num_losses` K > 1: a sequence of K grad states,
  None for a loss that reaches none of the model's params) unscales, skips non-finite steps
  and steps the masters.

Returning new objects instead would leave every other reference to the model on the float32
original, and a wrapper module would change the model's type and the paths of its state (so
its checkpoints). Everything is checked before anything is changed: an error leaves the
objects as they were.

A user's `nnx.jit` / `nnx.value_and_grad` training step therefore works unchanged except for
scaling the loss: `jamp.scale_loss(loss, optimizer.opt_state)`. `jamp.master_params`,
`jamp.state_dict` and `jamp.load_state_dict` take `optimizer.opt_state` (whose leaves NNX
wraps in `nnx.OptState` Variables; `load_state_dict` writes into them in place).

Optimizers pair with models by position (one per model; give a model twice for two
optimizers of one model). An `nnx.Optimizer` does not keep its model, so each pair is checked
by structure: the parameter-shaped trees in the optimizer's state must have the paths and
shapes of `nnx.state(model, optimizer.wrt)`.

Batch norms are found by walking the module graph: instances of `nnx.BatchNorm` (by type,
subclasses included) and any module that keeps `nnx.BatchStat` running statistics.
"""

from __future__ import annotations

import dataclasses
import types
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from flax.nnx.training.optimizer import to_opt_state

from jamp.frontend.casts import cast_floating, check_float32
from jamp.frontend.optimizers import (
    amp_optimizer,
    apex_loss_scale,
    as_transformation,
    param_dtypes,
)
from jamp.frontend.options import InitializeOptions, as_list, model_dtype
from jamp.policy.dtypes import is_inexact_array
from jamp.scaler import find_loss_scaled_states
from jamp.transforms import autocast


def initialize_nnx(models: Any, optimizers: Any, options: InitializeOptions):
    """Sets up Flax NNX models and optimizers, in place, for mixed precision at an Apex opt
    level. `jamp.initialize` calls it when given an `nnx.Module` (or a list of them).

    Args:
      models: an `nnx.Module`, or a list of them.
      optimizers: an `nnx.Optimizer` made for the model (`nnx.Optimizer(model, tx,
        wrt=nnx.Param)`), or a list of them, one per model in the same order; None for
        inference.
      options: `jamp.initialize`'s keywords. With `num_losses` K > 1,
        `optimizer.update(model, grads)` takes a sequence of K grad states (None for a loss
        that reaches none of the model's params).

    Returns:
      The models given, changed in place (a list where a list was given), or
      `(models, optimizers)` when optimizers were given: the same objects, as Apex returns.

    Raises:
      RuntimeError: an unknown opt level (Apex's message), a model or optimizer that
        `initialize` already set up, or an optimizer whose transformation scales losses
        already (`jamp.loss_scaled`).
      TypeError: a model that is not a callable `nnx.Module`, an optimizer that is not an
        `nnx.Optimizer`, or flags of the wrong type.
      ValueError: lists of different lengths, floating state that is not float32 (Apex's
        float32 check), `keep_batchnorm_fp32` given for a model without BatchNorm, an
        optimizer made for a model other than its partner, or a bad loss-scale setting.

    Example:
      >>> import jax, jax.numpy as jnp, optax, jamp
      >>> from flax import nnx
      >>> class Net(nnx.Module):
      ...     def __init__(self, rngs):
      ...         self.linear = nnx.Linear(3, 4, rngs=rngs)
      ...         self.bn = nnx.BatchNorm(4, rngs=rngs)
      ...     def __call__(self, x):
      ...         return self.bn(self.linear(x))
      >>> model = Net(nnx.Rngs(0))
      >>> optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
      >>> model, optimizer = jamp.initialize(model, optimizer, opt_level="O2", verbosity=0)
      >>> model.linear.kernel.dtype, model.bn.scale.dtype, model.bn.mean.dtype
      (dtype('float16'), dtype('float32'), dtype('float32'))
      >>> @nnx.jit
      ... def train_step(model, optimizer, x, y):
      ...     def loss_fn(model):
      ...         loss = jnp.mean((model(x) - y) ** 2)
      ...         return jamp.scale_loss(loss, optimizer.opt_state), loss
      ...     (_, loss), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
      ...     optimizer.update(model, grads)
      ...     return loss
      >>> x, y = jnp.ones((8, 3)), jnp.zeros((8, 4))
      >>> train_step(model, optimizer, x, y).dtype, model(x).dtype
      (dtype('float32'), dtype('float32'))
      >>> jamp.master_params(optimizer.opt_state)["linear"]["kernel"].dtype
      dtype('float32')
    """
    model_list, models_listed = as_list(models)
    opt_list, opts_listed = ([], False) if optimizers is None else as_list(optimizers)
    if optimizers is not None and len(opt_list) != len(model_list):
        raise ValueError(
            f"initialize got {len(model_list)} model(s) but {len(opt_list)} optimizer(s): the "
            f"NNX form pairs them by position, one nnx.Optimizer per model (give a model "
            f"twice for two optimizers of it).")
    if not options.enabled:
        return models if optimizers is None else (models, optimizers)
    options = options.checked_counts()
    where_model = lambda i: f"models[{i}]" if models_listed else "the model"
    where_opt = lambda i: f"optimizers[{i}]" if opts_listed else "the optimizer"
    unique = _unique(model_list)
    for i, model in enumerate(model_list):
        if any(model is m for m in model_list[:i]):
            continue
        _check_model(model, where_model(i))
    for i, optimizer in enumerate(opt_list):
        _check_optimizer(optimizer, where_opt(i), opt_list[:i])
        _check_pairing(optimizer, i, model_list, where_opt(i), where_model)

    props = options.properties()
    if options.keep_batchnorm_fp32 is not None:
        for i, model in enumerate(model_list):
            if not batch_norm_modules(model):
                raise ValueError(
                    f"keep_batchnorm_fp32={options.keep_batchnorm_fp32!r} was given, but "
                    f"{where_model(i)} has no BatchNorm layer (no nnx.BatchNorm, no module "
                    f"keeping nnx.BatchStat statistics): leave it None.")
    dtype = model_dtype(props)
    outputs_dtype = options.outputs_dtype(dtype)
    if opt_list:  # a bad floor or ceiling raises here, before anything is changed
        apex_loss_scale(props.loss_scale, options.min_loss_scale, options.max_loss_scale)

    keep_bn = bool(props.keep_batchnorm_fp32) if dtype is not None else True
    settings = _Settings(opt_level=props.opt_level, model_dtype=dtype,
                         autocast=bool(props.patch_torch_functions),
                         outputs_dtype=outputs_dtype)
    for model in unique:
        _amp_model(model, settings, keep_bn)
    allowed = param_dtypes(dtype, keep_bn)
    for optimizer, model in zip(opt_list, model_list):  # none, or one per model (checked)
        _amp_nnx_optimizer(optimizer, model, props, options, allowed)

    out_models = list(model_list) if models_listed else model_list[0]
    if optimizers is None:
        return out_models
    return out_models, list(opt_list) if opts_listed else opt_list[0]


def _unique(items: list) -> list:
    out: list = []
    for item in items:
        if not any(item is seen for seen in out):
            out.append(item)
    return out


# --- checks -----------------------------------------------------------------------------------


def _is_amp(node: Any) -> bool:
    return getattr(type(node), "_jamp_amp", False)


def _variables(model: Any) -> list[tuple[tuple, nnx.Variable]]:
    return [(tuple(path), v) for path, v in nnx.iter_graph(model, graph=True)
            if isinstance(v, nnx.Variable)]


def _path(path: tuple) -> str:
    return "".join(f"[{p!r}]" if not isinstance(p, str) else f".{p}" for p in path)


def _check_model(model: Any, where: str) -> None:
    if not isinstance(model, nnx.Module):
        raise TypeError(f"{where} must be an nnx.Module, got {type(model).__name__}: the NNX "
                        f"form takes NNX models (for linen, pass model.apply and variables).")
    if not callable(model):
        raise TypeError(f"{where} ({type(model).__name__}) has no __call__: jamp sets up a "
                        f"model's __call__, as Apex patches forward.")
    for path, node in nnx.iter_graph(model, graph=True):
        if _is_amp(node):
            inside = f" (its module at {_path(tuple(path))})" if path else ""
            raise RuntimeError(f"{where}{inside} was already set up by jamp.initialize: pass "
                               f"each model through initialize once.")
    for path, v in _variables(model):
        value = v.get_raw_value()
        if is_inexact_array(value):
            check_float32(f"{where}{_path(path)}", value.dtype)


def _check_optimizer(optimizer: Any, where: str, earlier: list) -> None:
    if not isinstance(optimizer, nnx.Optimizer):
        raise TypeError(
            f"{where} must be an nnx.Optimizer (nnx.Optimizer(model, tx, wrt=nnx.Param)), got "
            f"{type(optimizer).__name__}: the NNX form takes NNX optimizers.")
    if any(optimizer is o for o in earlier):
        raise ValueError(f"{where} is given twice: give each optimizer once.")
    as_transformation(optimizer.tx, where)
    if find_loss_scaled_states(optimizer.opt_state):
        raise RuntimeError(
            f"{where} already scales losses: its state holds a loss scale (a jamp.loss_scaled "
            f"inside its transformation), and the one initialize adds would unscale every grad "
            f"twice. Make the nnx.Optimizer with the plain optax transformation.")


def _state_kw(optimizer) -> dict:
    graph = vars(optimizer).get("graph")
    return {} if graph is None else {"graph": graph}


def _shapes(tree: Any) -> dict[str, tuple]:
    return {jax.tree_util.keystr(path): tuple(np.shape(leaf))
            for path, leaf in jax.tree_util.tree_leaves_with_path(nnx.as_pure(tree))}


def _fits(optimizer, model) -> bool | None:
    """Whether the optimizer's state was made for `model`: every parameter-shaped tree (an
    `nnx.State`) in it has paths and shapes of `nnx.state(model, wrt)`; None when its state
    holds no such tree (plain SGD) and cannot tell."""
    is_state = lambda x: isinstance(x, nnx.State)
    trees = [x for x in jax.tree_util.tree_leaves(optimizer.opt_state, is_leaf=is_state)
             if is_state(x)]
    trees = [t for t in (_shapes(t) for t in trees) if t]
    if not trees:
        return None
    want = _shapes(nnx.state(model, optimizer.wrt, **_state_kw(optimizer)))
    return all(all(want.get(path) == shape for path, shape in t.items()) for t in trees)


def _check_pairing(optimizer, i: int, models: list, where: str, where_model) -> None:
    if _fits(optimizer, models[i]) is not False:
        return
    others = [j for j, m in enumerate(models) if j != i and _fits(optimizer, m)]
    hint = (f"it fits {where_model(others[0])}: give the optimizers in the models' order, one "
            f"per model" if others else
            "it fits none of the models given: make it with nnx.Optimizer(model, tx, wrt=...) "
            "for the model it trains, and pass that model")
    raise ValueError(f"{where} was not made for {where_model(i)} (its state's parameter trees "
                     f"differ from nnx.state(model, wrt)): {hint}.")


# --- the model --------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Settings:
    """What an amp model's `__call__` does (part of its class, so of its graph definition)."""

    opt_level: str
    model_dtype: np.dtype | None
    autocast: bool
    outputs_dtype: np.dtype | None


def batch_norm_modules(model: Any) -> list[tuple[tuple, nnx.Module]]:
    """The batch norms in `model`'s graph, with their paths: instances of `nnx.BatchNorm` and
    modules that keep `nnx.BatchStat` running statistics."""
    found = []
    for path, node in nnx.iter_graph(model, graph=True):
        if isinstance(node, nnx.Module) and (
                isinstance(node, nnx.BatchNorm)
                or any(isinstance(v, nnx.BatchStat) for v in vars(node).values())):
            found.append((tuple(path), node))
    return found


def _amp_model(model, settings: _Settings, keep_bn: bool) -> None:
    """Casts `model`'s params (and batch statistics) in place and swaps in jamp's classes."""
    norms = [node for _, node in batch_norm_modules(model)]
    dtype = settings.model_dtype
    if dtype is not None:
        kept = {id(v) for norm in norms for _, v in _variables(norm)} if keep_bn else set()
        for _, v in _variables(model):
            value = v.get_raw_value()
            if not is_inexact_array(value) or np.dtype(value.dtype) == dtype:
                continue
            if isinstance(v, nnx.BatchStat) and not keep_bn:
                v.set_value(jnp.asarray(value).astype(dtype))
                _keep_dtype_on_write(v)
            elif isinstance(v, nnx.Param) and id(v) not in kept:
                v.set_value(jnp.asarray(value).astype(dtype))
        if keep_bn and dtype != np.float32:
            for norm in norms:
                _swap_class(norm, _half_output_class(type(norm), dtype))
    _swap_class(model, _amp_class(type(model), settings))


def _stored_in_own_dtype(variable, value):
    """An `on_set_value` hook: a floating array written into the Variable is stored in the
    dtype the Variable holds (BatchNorm computes its running averages in float32 and writes
    them into half statistics at O3)."""
    raw = variable.get_raw_value()
    if is_inexact_array(value) and is_inexact_array(raw) and value.dtype != raw.dtype:
        return jnp.asarray(value).astype(raw.dtype)
    return value


def _keep_dtype_on_write(variable) -> None:
    hooks = variable.get_metadata("on_set_value", ())
    hooks = tuple(hooks) if isinstance(hooks, (tuple, list)) else (hooks,)
    if _stored_in_own_dtype not in hooks:
        variable.set_metadata(on_set_value=hooks + (_stored_in_own_dtype,))


def _swap_class(node, cls) -> None:
    # object.__setattr__: the Pytree's __setattr__ would record `__class__` as an attribute.
    object.__setattr__(node, "__class__", cls)


_CLASSES: dict[tuple, type] = {}


def _subclass(base: type[nnx.Pytree], key: tuple, namespace: Callable[[], dict]) -> type:
    """jamp's subclass of `base` with the methods `namespace()` gives, made by
    `key[0](base, *key[1:])` (cached, so a class is made once and graph definitions of models
    set up alike compare equal). Same name and module as `base`; `pytree` as `base` was
    made; pickled as the function call that makes it again."""
    cached = _CLASSES.get((base, key))
    if cached is not None:
        return cached

    def __reduce__(self):
        return _new_instance, (key[0], (base, *key[1:])), self.__getstate__()

    def body(ns):
        ns.update(namespace(), __module__=base.__module__, __qualname__=base.__qualname__,
                  __doc__=base.__doc__, __reduce__=__reduce__, _jamp_amp=True,
                  _jamp_base=base)

    cls = types.new_class(base.__name__, (base,), {"pytree": base._pytree__is_pytree}, body)
    _CLASSES[(base, key)] = cls
    return cls


def _new_instance(make: Callable, args: tuple):
    """An empty instance of the class `make(*args)` makes (pickle then sets its state)."""
    return object.__new__(make(*args))


def _half_output_class(base: type[nnx.Pytree], dtype: np.dtype) -> type:
    """A batch norm whose floating outputs go back to `dtype` (Apex's float32 batch norm on
    half inputs returns half)."""

    def __call__(self, *args, **kwargs):
        return cast_floating(base.__call__(self, *args, **kwargs), dtype)

    return _subclass(base, (_half_output_class, dtype),
                     lambda: {"__call__": __call__, "_jamp_output_dtype": dtype})


def _amp_class(base: type[nnx.Pytree], settings: _Settings) -> type:
    def namespace():
        def call_base(module, *args, **kwargs):
            return base.__call__(module, *args, **kwargs)

        run = autocast(call_base, dtype=jnp.float16) if settings.autocast else call_base

        def __call__(self, *args, **kwargs):
            if settings.model_dtype is not None:
                args, kwargs = _outside_nnx((args, kwargs), settings.model_dtype)
            dtypes = _floating_dtypes(self)
            out = run(self, *args, **kwargs)
            _restore_dtypes(dtypes)
            if settings.outputs_dtype is None:
                return out
            return _outside_nnx(out, settings.outputs_dtype)

        return {"__call__": __call__, "_jamp_settings": settings}

    return _subclass(base, (_amp_class, settings), namespace)


def _outside_nnx(tree: Any, dtype: np.dtype) -> Any:
    """The linen form's `cast_floating(tree, dtype)` applied around the NNX objects in `tree`:
    an `nnx.Rngs`, module or Variable passed to (or returned by) the model is the caller's
    object, to be updated in place, not a cast copy."""
    is_nnx = lambda x: isinstance(x, (nnx.Variable, nnx.Pytree))
    has_to = lambda x: (callable(getattr(x, "to", None))
                        and not isinstance(x, (jax.Array, np.ndarray)))
    return jax.tree_util.tree_map(lambda x: x if is_nnx(x) else cast_floating(x, dtype), tree,
                                  is_leaf=lambda x: is_nnx(x) or has_to(x))


def _floating_dtypes(model) -> list[tuple[nnx.Variable, np.dtype]]:
    out = []
    for _, v in _variables(model):
        value = v.get_raw_value()
        if is_inexact_array(value):
            out.append((v, value.dtype))
    return out


def _restore_dtypes(dtypes) -> None:
    """Floating Variables back in the dtypes they had before the call (a float32 running
    average written into float16 statistics goes back to float16), as the linen form keeps
    mutated collections in their dtypes."""
    for v, dtype in dtypes:
        value = v.get_raw_value()
        if is_inexact_array(value) and value.dtype != dtype:
            v.set_value(value.astype(dtype))


# --- the optimizer ----------------------------------------------------------------------------


def _amp_nnx_optimizer(optimizer, model, props, options: InitializeOptions, allowed) -> None:
    """Gives `optimizer` jamp's transformation and a state made from the (cast) model."""
    params = nnx.state(model, optimizer.wrt, **_state_kw(optimizer))
    num_losses = options.num_losses
    tx = amp_optimizer(as_transformation(optimizer.tx, "the optimizer"), props, num_losses,
                       options.min_loss_scale, options.max_loss_scale, allowed, [params])
    opt_state = to_opt_state(tx.init(params))
    optimizer.tx = tx
    optimizer.opt_state = nnx.data(opt_state)
    if num_losses > 1:
        _swap_class(optimizer, _multi_loss_class(type(optimizer), num_losses))


def _multi_loss_class(base: type[nnx.Pytree], num_losses: int) -> type:
    """An optimizer whose `update(model, grads)` takes K grad states, one per loss (None for a
    loss that reaches none of the params), as `loss_scaled(num_losses=K)` does."""

    def update(self, model, grads, /, **kwargs):
        if not isinstance(grads, (list, tuple)) or len(grads) != num_losses:
            raise ValueError(
                f"this optimizer was set up with num_losses={num_losses}: update(model, grads) "
                f"takes a sequence of {num_losses} grad states (None for a loss that reaches "
                f"none of the params), got {type(grads).__name__}.")
        kw = _state_kw(self)
        params = nnx.as_pure(nnx.state(model, self.wrt, **kw))
        pure_grads = [None if g is None else nnx.as_pure(nnx.state(g, self.wrt, **kw))
                      for g in grads]
        updates, new_opt_state = self.tx.update(pure_grads, nnx.as_pure(self.opt_state),
                                                params, **nnx.as_pure(kwargs))
        nnx.update(model, optax.apply_updates(params, updates))
        nnx.update(self.opt_state, nnx.state(new_opt_state, **kw))
        self.step[...] += 1
        return updates

    return _subclass(base, (_multi_loss_class, num_losses),
                     lambda: {"update": update, "_jamp_num_losses": num_losses})


__all__ = ["batch_norm_modules", "initialize_nnx"]
