"""Checkpoints of a whole mixed-precision training state that refuse to restore into the wrong one.

Everything jamp keeps is a pytree of arrays (the loss scales with their counters, the float32
master weights, the wrapped optimizer's state), so orbax and `flax.serialization` save it like
any other state. What they do not do is notice that the state a checkpoint is restored into was
set up differently: orbax casts a float16 param into a float32 target without a word, and both
report another number of loss scales as a tree mismatch deep in the optimizer state. So a jamp
checkpoint carries its *layout* (`checkpoint_layout`: the loss scales per optimizer, where the
master weights are, every leaf's dtype and shape), and restoring compares it with the target's
first and names what differs in Apex's words: `num_losses`, the opt level, the dtype of a param.

The mesh is not part of the layout: a checkpoint holds global arrays, and restoring puts each
onto the sharding of the target's leaf, so a state saved on 8 devices resumes on 4 or 16, on
another process count, replicated or sharded (a reshard).

Two ways to store:

- `save_checkpoint` / `restore_checkpoint`: an `orbax.checkpoint.CheckpointManager` (asynchronous
  when the manager is, every process of a multi-host job writing its own shards). orbax is an
  optional dependency (`pip install jamp-amp[checkpoint]`), imported only by these two.
- `checkpoint_to_bytes` / `checkpoint_from_bytes`: msgpack bytes through `flax.serialization`,
  for single-process training.
"""

from __future__ import annotations

import sys
from typing import Any, Sequence

import jax
from flax import serialization

from jamp.frontend.masters import MasterWeightsState, plain_state
from jamp.scaler import LossScaledState

# The key of the layout in a checkpoint's metadata (orbax) or msgpack dict (flax).
_LAYOUT_KEY = "jamp_layout"
# How many differences of one kind an error lists before it counts the rest.
_SHOWN = 6


def checkpoint_layout(state: Any) -> dict[str, Any]:
    """What a checkpoint of `state` holds, as JSON-able facts for `check_checkpoint_layout`.

    Args:
      state: the training state (any pytree: a dict of params and optimizer state, a Flax
        `TrainState`), with arrays or `jax.ShapeDtypeStruct`s as leaves.

    Returns:
      A dict: `loss_scales` maps the path of each `loss_scaled` state to the kinds of its loss
      scales (one per loss); `master_weights` lists the paths of the float32 master weights
      (opt level O2); `leaves` maps every leaf's path to its dtype and shape.

    Example:
      >>> import jax.numpy as jnp, optax, jamp
      >>> from jamp.frontend.checkpoint import checkpoint_layout
      >>> params = {"w": jnp.zeros(3, jnp.float16)}
      >>> tx = jamp.master_weights(jamp.loss_scaled(optax.sgd(0.1)))
      >>> layout = checkpoint_layout({"params": params, "opt_state": tx.init(params)})
      >>> layout["loss_scales"], layout["master_weights"], layout["leaves"]["['params']['w']"]
      ({"['opt_state'].inner_state": ['GradScalerState']}, ["['opt_state']"], 'float16[3]')
    """
    state = plain_state(state)
    loss_scales, masters = _amp_parts(state, "")
    leaves = {jax.tree_util.keystr(path): _leaf_type(leaf)
              for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]}
    return {"loss_scales": loss_scales, "master_weights": masters, "leaves": leaves}


def _amp_parts(tree: Any, prefix: str) -> tuple[dict[str, list[str]], list[str]]:
    """The kinds of the loss scales of each `loss_scaled` state in `tree`, and the paths of
    the master weights, by path (each after `prefix`)."""
    is_amp = lambda x: isinstance(x, (LossScaledState, MasterWeightsState))
    loss_scales, masters = {}, []
    for path, node in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_amp)[0]:
        where = prefix + jax.tree_util.keystr(path)
        if isinstance(node, MasterWeightsState):
            inner_scales, inner_masters = _amp_parts(node.inner_state, where + ".inner_state")
            loss_scales.update(inner_scales)
            masters += [where, *inner_masters]
        elif isinstance(node, LossScaledState):
            scales = node.loss_scale if isinstance(node.loss_scale, tuple) else (node.loss_scale,)
            loss_scales[where] = [type(s).__name__ for s in scales]
    return loss_scales, masters


def _leaf_type(leaf: Any) -> str:
    if hasattr(leaf, "dtype") and hasattr(leaf, "shape"):
        return f"{leaf.dtype}[{','.join(map(str, leaf.shape))}]"
    return type(leaf).__name__


def check_checkpoint_layout(saved: dict[str, Any], target: Any) -> None:
    """Raises a `ValueError` naming every way the checkpoint of layout `saved` does not fit
    `target`; returns None when it fits.

    Args:
      saved: the layout stored with the checkpoint (`checkpoint_layout` of the saved state).
      target: the state to restore into.

    Raises:
      ValueError: another number of loss scales (`num_losses`) or kind of loss scale, master
        weights on one side only (O2 against O0, O1, O3), or leaves that differ in path,
        dtype or shape (a param in float16 against float32: another opt level).
    """
    here = checkpoint_layout(target)
    problems = _amp_differences(saved, here) or _leaf_differences(saved["leaves"],
                                                                   here["leaves"])
    if problems:
        raise ValueError("This checkpoint does not fit the state it is restored into:\n"
                         + "\n".join(f"  - {p}" for p in problems))


def _amp_differences(saved: dict, here: dict) -> list[str]:
    problems = []
    if bool(saved["master_weights"]) != bool(here["master_weights"]):
        has, lacks = ("checkpoint", "target") if saved["master_weights"] else ("target",
                                                                                 "checkpoint")
        paths = saved["master_weights"] or here["master_weights"]
        problems.append(
            f"the {has} keeps float32 master weights (at {', '.join(paths)}: opt level O2 or "
            f"master_weights=True) and the {lacks} keeps none (O0, O1, O3): restore into a "
            f"state set up at the opt level the checkpoint was saved at.")
    saved_scales, scales = list(saved["loss_scales"].values()), list(here["loss_scales"].values())
    if len(saved_scales) != len(scales):
        problems.append(f"the checkpoint holds {len(saved_scales)} loss_scaled optimizer "
                        f"state(s), the target {len(scales)}.")
    for (saved_at, old), (at, new) in zip(saved["loss_scales"].items(),
                                          here["loss_scales"].items()):
        if len(old) != len(new):
            problems.append(
                f"the checkpoint's optimizer at {saved_at} has {len(old)} loss scale(s) "
                f"(num_losses={len(old)}), the target's at {at} has {len(new)} "
                f"(num_losses={len(new)}): set num_losses={len(old)} as when it was saved.")
        elif old != new:
            problems.append(
                f"the checkpoint's loss scales at {saved_at} are {old}, the target's at {at} "
                f"{new}: a static scale (O0, O3, a number) against a dynamic one (O1, O2, "
                f"'dynamic'), or another scaler class.")
    return problems


def _leaf_differences(saved: dict[str, str], here: dict[str, str]) -> list[str]:
    problems = []
    missing = [p for p in here if p not in saved]
    extra = [p for p in saved if p not in here]
    if missing:
        problems.append(f"the checkpoint lacks {_listed(missing)}, which the target has.")
    if extra:
        problems.append(f"the checkpoint holds {_listed(extra)}, which the target lacks.")
    changed = [f"{p} is {saved[p]} in the checkpoint and {here[p]} in the target"
               for p in here if p in saved and saved[p] != here[p]]
    if changed:
        problems.append(f"{_listed(changed)}: float16 or bfloat16 params come from O2 or O3 "
                        f"(or cast_model_type), float32 ones from O0 or O1.")
    return problems


def _listed(items: Sequence[str]) -> str:
    shown = ", ".join(items[:_SHOWN])
    return shown if len(items) <= _SHOWN else f"{shown} and {len(items) - _SHOWN} more"


# --- orbax -------------------------------------------------------------------------------------


def _orbax():
    try:
        import orbax.checkpoint as ocp
    except ImportError as e:
        raise ImportError("save_checkpoint and restore_checkpoint write with orbax: install it "
                          "with `pip install jamp-amp[checkpoint]` (or orbax-checkpoint), or "
                          "use checkpoint_to_bytes / checkpoint_from_bytes in one process.") from e
    return ocp


def save_checkpoint(manager: Any, step: int, state: Any, *, force: bool = False) -> bool:
    """Saves `state` as checkpoint `step` of an orbax `CheckpointManager`, with its layout.

    Every process of a multi-host job calls it with the same `step`; each writes the shards it
    holds. With `enable_async_checkpointing` (orbax's default) it returns once the arrays are
    copied off the devices and writes in the background; a checkpoint becomes the latest only
    when every process has finished it, so a crash mid-write leaves the one before.

    Args:
      manager: an `orbax.checkpoint.CheckpointManager` for one item (no `item_names`).
      step: the checkpoint's number (the count of training steps done, say).
      state: the training state (params, optimizer state with jamp's parts, anything else).
      force: save even when the manager's `save_interval_steps` says not to.

    Returns:
      Whether a checkpoint was started (the manager's interval decides, unless `force`).

    Example:
      >>> import tempfile, jax.numpy as jnp, optax, jamp, orbax.checkpoint as ocp
      >>> params = {"w": jnp.ones(3)}
      >>> tx = jamp.loss_scaled(optax.sgd(0.1))
      >>> state = {"params": params, "opt_state": tx.init(params)}
      >>> manager = ocp.CheckpointManager(tempfile.mkdtemp())
      >>> jamp.save_checkpoint(manager, 0, state)
      True
      >>> manager.wait_until_finished()
      >>> float(jamp.get_loss_scale(jamp.restore_checkpoint(manager, state)["opt_state"])
      ...       .loss_scale)
      65536.0
    """
    ocp = _orbax()
    return manager.save(step, args=ocp.args.StandardSave(state), force=force,
                        custom_metadata={_LAYOUT_KEY: checkpoint_layout(state)})


def restore_checkpoint(manager: Any, target: Any, step: int | None = None) -> Any:
    """Checkpoint `step` (the latest by default) of `manager`, restored into `target`'s
    structure, dtypes and shardings.

    Every process of a multi-host job calls it; each reads the shards its devices hold. Each
    leaf lands on the sharding of `target`'s leaf, whatever mesh it was saved from.

    Args:
      manager: the `orbax.checkpoint.CheckpointManager` that `save_checkpoint` wrote with.
      target: a state of the same set-up (what the fresh run builds before training), with
        arrays or `jax.ShapeDtypeStruct`s (with shardings) as leaves.
      step: which checkpoint; None for the latest.

    Raises:
      FileNotFoundError: the manager holds no checkpoint (or not `step`).
      ValueError: the checkpoint does not fit `target` (see `check_checkpoint_layout`), or it
        was written without its layout (not by `save_checkpoint`).
    """
    ocp = _orbax()
    step = manager.latest_step() if step is None else step
    if step is None or step not in manager.all_steps():
        raise FileNotFoundError(f"{manager.directory} holds no checkpoint"
                                + ("" if step is None else f" {step}")
                                + f" (it holds {list(manager.all_steps())}).")
    abstract = jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, target)
    try:
        restored = manager.restore(step, args=ocp.args.StandardRestore(abstract))
    except (ValueError, KeyError, TypeError):
        # orbax refused the tree: say in jamp's words what differs, if the layout tells.
        _check_saved_layout(manager, step, target)
        raise
    # orbax casts each leaf to the target's dtype: the layout says whether that was a mistake.
    _check_saved_layout(manager, step, target)
    return restored


def _check_saved_layout(manager: Any, step: int, target: Any) -> None:
    layout = (manager.metadata(step).custom_metadata or {}).get(_LAYOUT_KEY)
    if layout is None:
        raise ValueError(f"checkpoint {step} in {manager.directory} has no jamp layout: it was "
                         f"not written by jamp.save_checkpoint. Restore it with orbax itself "
                         f"(ocp.args.StandardRestore).")
    check_checkpoint_layout(layout, target)


# --- flax.serialization ------------------------------------------------------------------------


def checkpoint_to_bytes(state: Any) -> bytes:
    """`state` and its layout as msgpack bytes (`flax.serialization`), for one process.

    `state` is any pytree of arrays; Flax NNX States in it are stored as their values.

    Raises:
      ValueError: in a multi-process job, where no process holds every array: use
        `save_checkpoint`.

    Example:
      >>> import jax.numpy as jnp, optax, jamp
      >>> params = {"w": jnp.ones(3)}
      >>> tx = jamp.loss_scaled(optax.sgd(0.1), num_losses=2)
      >>> blob = jamp.checkpoint_to_bytes({"params": params, "opt_state": tx.init(params)})
      >>> other = jamp.loss_scaled(optax.sgd(0.1))
      >>> jamp.checkpoint_from_bytes({"params": params, "opt_state": other.init(params)}, blob)
      Traceback (most recent call last):
      ...
      ValueError: This checkpoint does not fit the state it is restored into:
        - the checkpoint's optimizer at ['opt_state'] has 2 loss scale(s) (num_losses=2), ...
    """
    if jax.process_count() > 1:
        raise ValueError(f"checkpoint_to_bytes needs every array in this process, but this is "
                         f"process {jax.process_index()} of {jax.process_count()}: save with "
                         f"save_checkpoint (orbax), which each process writes its shards to.")
    return serialization.msgpack_serialize({
        _LAYOUT_KEY: checkpoint_layout(state),
        "state": serialization.to_state_dict(_nnx_states_as_dicts(state))})


def checkpoint_from_bytes(target: Any, blob: bytes) -> Any:
    """What `checkpoint_to_bytes` wrote, restored into `target`'s structure and shardings.

    Each array is put on the sharding of `target`'s leaf (its device, or a mesh other than the
    one it was saved from).

    Args:
      target: a state of the same set-up, with arrays or `jax.ShapeDtypeStruct`s as leaves (a
        `jax.eval_shape` of it: concrete arrays come back, on the default device where a leaf
        names no sharding); Flax NNX States (`nnx.state((model, optimizer))`) anywhere in it.
      blob: the bytes.

    Raises:
      ValueError: the checkpoint does not fit `target` (see `check_checkpoint_layout`), or the
        bytes are not `checkpoint_to_bytes`'s, or are cut short or damaged (msgpack's error as
        the cause).
    """
    try:
        saved = serialization.msgpack_restore(blob)
    except (ValueError, TypeError) as e:
        # msgpack's words name a byte, not the file: say what was read. A cut or damaged array
        # inside fails in flax's array decoding, as a TypeError or ValueError of numpy's.
        leaves = len(jax.tree_util.tree_leaves(target))
        raise ValueError(f"these bytes are not a whole jamp checkpoint (checkpoint_to_bytes's "
                         f"msgpack) for the target, a {type(target).__name__} of {leaves} "
                         f"arrays: they are cut short or damaged ({type(e).__name__}).") from e
    if not isinstance(saved, dict) or _LAYOUT_KEY not in saved:
        raise ValueError("these bytes hold no jamp layout: they were not written by "
                         "checkpoint_to_bytes (flax.serialization.from_bytes reads "
                         "flax.serialization.to_bytes's).")
    check_checkpoint_layout(saved[_LAYOUT_KEY], target)
    values = serialization.from_state_dict(_nnx_states_as_dicts(target), saved["state"])
    # The values in the target's own structure (its NNX States and Variables back), leaf for
    # leaf: a State's dict keeps its sorted keys, so both flatten in one order.
    restored = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(target),
                                            jax.tree_util.tree_leaves(values))
    return jax.tree_util.tree_map(_placed_like, restored, target)


def _nnx_states_as_dicts(tree: Any) -> Any:
    """`tree` with each Flax NNX `State` in it as the nested dict of its values
    (`nnx.to_pure_dict`), which flax.serialization stores (it has no handler for a State).
    Returns `tree` itself where flax.nnx was never imported, so no State can exist."""
    nnx = sys.modules.get("flax.nnx")
    if nnx is None:
        return tree
    is_state = lambda x: isinstance(x, nnx.State)
    return jax.tree_util.tree_map(lambda x: nnx.to_pure_dict(x) if is_state(x) else x, tree,
                                  is_leaf=is_state)


def _placed_like(value: Any, like: Any) -> Any:
    """`value` as an array on `like`'s sharding where `like` is an array or an abstract one
    (`jax.ShapeDtypeStruct`, on the default device when it names no sharding)."""
    if isinstance(like, (jax.Array, jax.ShapeDtypeStruct)):
        return jax.device_put(value, like.sharding)
    return value


__all__: Sequence[str] = ("checkpoint_layout", "check_checkpoint_layout", "save_checkpoint",
                          "restore_checkpoint", "checkpoint_to_bytes", "checkpoint_from_bytes")
