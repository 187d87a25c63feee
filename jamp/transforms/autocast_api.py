"""`jamp.autocast`: torch.autocast as a JAX function transform, and its regions."""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax

from jamp._checks import check_bool
from jamp.fp8 import autocast_state as fp8_state
from jamp.fp8.recipes import Recipe
from jamp.policy.autocast_tables import (
    OpTable, autocast_table, canonical_device_type, check_autocast_dtype)
from jamp.policy.dtypes import is_fp8_dtype
from jamp.transforms import autocast_rules, autocast_state
from jamp.transforms import boundary, programs
from jamp.transforms import rules as precision_rules


def autocast(
    fn: Callable | str | None = None,
    *torch_args: Any,
    device_type: str | None = None,
    dtype: Any = None,
    enabled: bool = True,
    cache_enabled: bool | None = None,
    op_table: OpTable | None = None,
    cast_outputs: bool = True,
    rules: Any = None,
):
    """torch.autocast for JAX: runs `fn` with each op in the dtype its device's table says.

    With `fn`, returns the transformed function: it traces `fn` to a jaxpr and evaluates it
    with matmuls and convolutions in `dtype`, the ops of the float32 list in float32 and every
    other op in the widest floating dtype of its inputs. It composes with `jax.jit`,
    `jax.grad` (the backward runs in the forward's dtypes, grads come back in the params'
    dtypes), `jax.vmap` and sharding. Array arguments (any pytree) are traced; other leaves
    (Python scalars, strings, flags) are passed through as static values. NNX modules, as
    arguments or closed over, are updated as the call without autocast would update them.
    A call is an eager call: `fn` runs on every call (traced, so that whatever Python state it
    reads, an object's field or a global, is read afresh, and arguments, NNX state and
    closed-over arrays too), and its autocast program is transformed and compiled once per
    distinct traced program and reused while the trace stays the same. Under `jax.jit` it runs
    when jit traces, as `fn` alone would.

    Without `fn`, returns an `AutocastRegion`: used as a decorator it transforms the function;
    used as `with jamp.autocast(enabled=False):` (or `dtype=...`) inside a function being
    transformed, it marks a region whose ops run with autocast off (their inputs cast back to
    the dtypes the program was written in, float32 for a float32 program) or in another dtype.
    Regions nest. A region outside any transformed function does nothing.

    torch's call form works too: a device type string first, then torch's positional
    `dtype, enabled, cache_enabled` (`jamp.autocast("cuda", jnp.float16)` or
    `jamp.autocast("cuda", dtype=jnp.float16)`), as a region, a decorator or applied to a
    function.

    Args:
      fn: the function to transform, or torch's positional device type.
      *torch_args: after a device type only: torch's positional dtype, enabled,
        cache_enabled.
      device_type: "cuda" (or its aliases "gpu" and "rocm"), "cpu" or "tpu"; default:
        `jax.default_backend()`.
      dtype: the low dtype; default float16 on cuda/gpu, bfloat16 on cpu and tpu. float16 on
        the CPU works: XLA emulates it. An fp8 recipe (`jamp.fp8.recipe("tensorwise")`) runs
        every linear layer's product through `jamp.fp8` and the rest in the default dtype
        (docs/fp8.md); a float8 dtype is refused with a message saying how to write one.
      enabled: False returns `fn` unchanged (as a region: autocast off inside).
      cache_enabled: accepted for torch compatibility (default True). True casts each value
        to each dtype once per (sub-)program, so a weight used by several matmuls is converted
        once; False emits a convert per use, which XLA's CSE usually merges again.
      op_table: a custom `OpTable` (see `jamp.policy.autocast_table(...).updated(...)`).
      cast_outputs: True (default) returns outputs in the dtypes `fn` returns; False keeps the
        dtypes autocast computed them in (e.g. bfloat16 logits), torch's behaviour.
      rules: precision rules, `[(pattern, setting), ...]`, tried in order before the op
        table's own function rules; the first that matches an equation decides it. A pattern
        is a glob over module paths (Flax linen's `Net/BatchNorm_0`, `jax.named_scope` names,
        NNX modules by graph path: `"BatchNorm_*"`, `"/Net/Dense_0"` from the top, `"**"` for
        all) or the qualified name of a Python function or class (`"optax.ctc_loss"`,
        `"flax.nnx.BatchNorm"`). A setting is a dtype (`jnp.float32`: the module computes in
        it, its matmuls too, and reads the activations autocast lowered before it in it),
        `"off"` (autocast off: the program's own dtypes), `"on"` (the transform's dtype and
        table, no rule), an `OpTable` or an fp8 recipe (the module's linear layers, Dense,
        DenseGeneral, Einsum and Conv, multiply in float8; docs/fp8.md). Regions opened
        inside a matched module nest inside it. A rule that decides no equation when `fn`
        is traced is an error. See `jamp.transforms.rules`.

    Raises:
      ValueError: for an unknown `device_type` or a `dtype` that is not float16, bfloat16 or
        float32, naming the accepted ones.
      TypeError: for a first argument that is neither a function nor a device type string, a
        device type given both ways, a device type that is not a string, or an `enabled`,
        `cache_enabled` or `cast_outputs` that is not a bool (the string "False" is refused,
        not read as true); for `rules` that are not (pattern, setting) pairs.
      ValueError (when `fn` is traced): for a rule that decides no equation, naming it.

    Example:
      >>> import jax, jax.numpy as jnp, jamp
      >>> def loss_fn(w, x):
      ...     return jnp.mean(jnp.tanh(x @ w))
      >>> loss = jamp.autocast(loss_fn, dtype=jnp.bfloat16)
      >>> w, x = jnp.ones((4, 2)), jnp.ones((3, 4))
      >>> grads = jax.jit(jax.grad(loss))(w, x)  # the matmuls ran in bfloat16
      >>> grads.dtype  # grads come back in the params' dtype
      dtype('float32')

      Rules: BatchNorm kept in float32, one Dense forced to float32 (float16 elsewhere):

      >>> import flax.linen as nn
      >>> class Net(nn.Module):
      ...     @nn.compact
      ...     def __call__(self, x):
      ...         x = nn.BatchNorm(use_running_average=True)(nn.Dense(4)(x))
      ...         return nn.Dense(2)(x)
      >>> net, x = Net(), jnp.ones((3, 4))
      >>> variables = net.init(jax.random.key(0), x)
      >>> apply = jamp.autocast(net.apply, device_type="cuda", cast_outputs=False,
      ...                       rules=[("BatchNorm_*", jnp.float32), ("Dense_1", "float32")])
      >>> apply(variables, x).dtype
      dtype('float32')
    """
    if isinstance(fn, str):  # torch.autocast("cuda", torch.float16, ...)
        if device_type is not None:
            raise TypeError(
                f"jamp.autocast got the device type twice: {fn!r} as its first argument and "
                f"device_type={device_type!r}.")
        fn, device_type = None, fn
        dtype, enabled, cache_enabled = _torch_positional(
            torch_args, dtype=dtype, enabled=enabled, cache_enabled=cache_enabled)
    elif torch_args:
        raise TypeError(
            f"jamp.autocast takes its options by keyword after a function; got "
            f"{len(torch_args)} more positional argument(s) {torch_args!r}. Only torch's "
            "form, with a device type string first, takes dtype, enabled and cache_enabled "
            "by position.")
    if fn is not None and not callable(fn):
        raise TypeError(
            f"jamp.autocast's first argument must be a function to transform or a device type "
            f"string such as 'cuda' (torch's form); got {fn!r} of type {type(fn).__name__}.")
    region = AutocastRegion(device_type=device_type, dtype=dtype, enabled=enabled,
                            cache_enabled=cache_enabled, op_table=op_table,
                            cast_outputs=cast_outputs, rules=rules)
    return region if fn is None else region(fn)


def _torch_positional(args: tuple, **keywords) -> tuple:
    """torch.autocast(device_type, dtype=None, enabled=True, cache_enabled=None): the options
    given by position, refusing one given both ways or too many."""
    names = ("dtype", "enabled", "cache_enabled")
    if len(args) > len(names):
        raise TypeError(f"torch.autocast's form takes at most {len(names)} positional options "
                        f"after the device type ({', '.join(names)}); got {args!r}.")
    defaults = {"dtype": None, "enabled": True, "cache_enabled": None}
    for name, value in zip(names, args):
        if keywords[name] is not defaults[name]:
            raise TypeError(f"jamp.autocast got {name} twice: {value!r} by position and "
                            f"{keywords[name]!r} by keyword.")
        keywords[name] = value
    return tuple(keywords[name] for name in names)


class AutocastRegion:
    """The object `jamp.autocast()` returns without a function: a decorator (the transform)
    and a context manager (a region inside a transformed function)."""

    def __init__(self, *, device_type=None, dtype=None, enabled=True, cache_enabled=None,
                 op_table=None, cast_outputs=True, rules=None):
        enabled = check_bool("enabled", enabled)
        cast_outputs = check_bool("cast_outputs", cast_outputs)
        cache_enabled = True if cache_enabled is None else check_bool("cache_enabled",
                                                                       cache_enabled)
        self._explicit_device = device_type is not None
        if device_type is None:
            device_type = op_table.device_type if op_table is not None else jax.default_backend()
        self.device_type = canonical_device_type(device_type)
        self.table = op_table if op_table is not None else autocast_table(self.device_type)
        # An fp8 recipe as the dtype: every linear layer's product in fp8, the rest in the
        # device's default dtype (as rules=[("**", recipe)] on a transform without a dtype).
        self.fp8 = (precision_rules.check_fp8_setting(dtype, "autocast dtype")
                    if isinstance(dtype, Recipe) or is_fp8_dtype(dtype) else None)
        self._explicit_dtype = dtype is not None and self.fp8 is None
        self.dtype = (check_autocast_dtype(dtype) if self._explicit_dtype
                      else self.table.default_dtype)
        self.enabled = enabled
        self.cache_enabled = cache_enabled
        self.cast_outputs = cast_outputs
        self._custom_table = op_table is not None
        self._rules = precision_rules.checked_rules(rules)
        self._scopes: list = []

    def __repr__(self):
        return (f"autocast(device_type={self.device_type!r}, dtype={self.dtype.name}, "
                f"enabled={self.enabled}, cache_enabled={self.cache_enabled})")

    @property
    def scope_name(self) -> str:
        """The `jax.named_scope` name that marks this region in a traced program."""
        return autocast_rules.marker(
            enabled=self.enabled,
            device=self.device_type if self._explicit_device else None,
            dtype=self.dtype if self._explicit_dtype else None)

    def __enter__(self):
        if self.fp8 is not None:
            raise ValueError(
                "An fp8 recipe applies to a transform (jamp.autocast(fn, dtype=recipe), or a "
                "module's rule: rules=[(pattern, recipe)]); a region (`with "
                "jamp.autocast(...)`) sets only enabled, dtype and device_type.")
        if self._custom_table or self._rules:
            given = "op_table applies" if self._custom_table else "rules apply"
            raise ValueError(
                f"{given} to a transform (jamp.autocast(fn, {given.split()[0]}=...)); a region "
                "(`with jamp.autocast(...)`) sets only enabled, dtype and device_type.")
        scope = jax.named_scope(self.scope_name)
        scope.__enter__()
        self._scopes.append(scope)
        return self

    def __exit__(self, *exc):
        return self._scopes.pop().__exit__(*exc)

    def __call__(self, fn: Callable) -> Callable:
        if not callable(fn):
            raise TypeError(f"autocast(...) decorates a function; got {fn!r} of type "
                            f"{type(fn).__name__}.")
        if not self.enabled:
            @functools.wraps(fn)
            def disabled(*args, **kwargs):
                with jax.named_scope(self.scope_name):
                    return fn(*args, **kwargs)
            return disabled

        region = precision_rules.with_rules(
            autocast_rules.Region(enabled=True, dtype=self.dtype, table=self.table,
                                  fp8=self.fp8),
            precision_rules.rule_set(self._rules, self.table))
        settings = (region, self.cache_enabled, self.cast_outputs)

        def program_for(call: boundary.Call, delayed: bool) -> programs.Program:
            # `fn` runs on every call, as it does without autocast (under jax.jit, when jit
            # traces): what it reads is read now. The cache saves the transform and the compile.
            # What `fn` asks of autocast while it is traced (jamp.is_autocast_enabled) is
            # answered for this transform.
            with autocast_state.tracing(region):
                traced = programs.Trace(fn, call)
            cache = programs.cache_for(fn)
            key = traced.key(call, region)
            key = None if key is None else (settings, delayed, key)
            program = cache.get(key) if key is not None else None
            if program is None or not program.valid_for(call):
                program = programs.Program.build(fn, traced, call, region, self.cache_enabled,
                                                 self.cast_outputs, delayed)
                if program.cacheable and key is not None:
                    cache.put(key, program)
            return program

        def run(delayed_state, args, kwargs):
            call = boundary.Call.of(fn, args, kwargs)
            program = program_for(call, delayed_state is not None)
            with jax.named_scope(self.scope_name):
                return program.run(call, delayed_state)

        def init_delayed(args, kwargs):
            return program_for(boundary.Call.of(fn, args, kwargs), True).initial_state()

        @functools.wraps(fn)
        def transformed(*args, **kwargs):
            return run(None, args, kwargs)

        # What it is, for tools that take a function not yet transformed (`jamp.debug`).
        transformed.__jamp_autocast__ = repr(self)  # type: ignore[attr-defined]  # marks it
        # The delayed fp8 recipe's state, for jamp.fp8.init_autocast_state and with_state.
        setattr(transformed, fp8_state.STATE_CALLS, fp8_state.StateCalls(init_delayed, run))
        return transformed


__all__ = ["autocast", "AutocastRegion"]
