"""A Flax CNN with BatchNorm on scikit-learn's 8x8 digits, trained at Apex's O0, O1, O2 and O3.

The digits (1,797 handwritten 8x8 images, shipped with scikit-learn: no download) are split
75/25 into train and test. One linen CNN (two convolutions, each followed by BatchNorm and a
ReLU, then a Dense layer) is set up four times with

    apply_fn, variables, tx = jamp.initialize(model.apply, variables, optax.adam(lr),
                                              opt_level=level)

from the same initial variables, and each copy is trained on the same batches, the Flax way:
`mutable=["batch_stats"]` while training, the running averages (`use_running_average`) at test
time. The script prints, per opt level, the dtypes of the conv and dense params, the BatchNorm
params, the batch statistics and the optimizer's master weights, the dtypes the convs and
matmuls compute in (read from the lowered training step), the loss at the start and the end,
the skipped steps, the largest |param| and the test accuracy; then what they show.
`--verbosity 1` also prints `jamp.initialize`'s "Selected optimization level" blocks.
"""

from __future__ import annotations

import argparse
import collections
import re
import time
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jamp

LEVELS = ("O0", "O1", "O2", "O3")
# A conv or matmul of the lowered program and the element type of its first operand.
_CONV_OR_MATMUL = re.compile(
    r"stablehlo\.(?:convolution|dot_general)\b.*?: \(tensor<(?:\d+x)*(\w+)>")


class CNN(nn.Module):
    """Conv-BatchNorm-ReLU twice, then a Dense layer to the 10 digit classes."""

    @nn.compact
    def __call__(self, x, train: bool):
        for features, stride in ((16, 1), (32, 2)):
            x = nn.Conv(features, (3, 3), strides=stride, use_bias=False)(x)
            x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
            x = nn.relu(x)
        return nn.Dense(10)(x.reshape((x.shape[0], -1)))


def load_data(seed: int = 0) -> dict[str, np.ndarray]:
    """The digits as float32 images in [0, 1] of shape (N, 8, 8, 1), split 75/25."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    images = (digits.images / 16.0).astype(np.float32)[..., None]
    x_train, x_test, y_train, y_test = train_test_split(
        images, digits.target.astype(np.int32), test_size=0.25, random_state=seed,
        stratify=digits.target)
    return dict(x_train=x_train, y_train=y_train, x_test=x_test, y_test=y_test)


def batch_order(num_examples: int, batch_size: int, steps: int, seed: int) -> np.ndarray:
    """The example indices of every step's batch, shape (steps, batch_size): shuffled epochs."""
    rng = np.random.default_rng(seed)
    epochs = -(-steps * batch_size // num_examples)
    order = np.concatenate([rng.permutation(num_examples) for _ in range(epochs)])
    return order[:steps * batch_size].reshape(steps, batch_size)


def make_grads(apply_fn: Callable) -> Callable:
    """`grads(state, x, y) -> (grads, loss, batch_stats)`, not yet jitted: the grads of the
    loss scaled by the loss scale in `opt_state` (`jamp.scale_loss`; what `tx.update` takes),
    the loss, and the batch statistics the forward pass updated. `state` is
    `(params, batch_stats, opt_state)`."""

    def grads(state, x, y):
        params, batch_stats, opt_state = state

        def scaled_loss(params):
            logits, updates = apply_fn({"params": params, "batch_stats": batch_stats}, x,
                                       train=True, mutable=["batch_stats"])
            # The cross-entropy in float32, whatever dtype the model computed in.
            loss = optax.softmax_cross_entropy_with_integer_labels(
                logits.astype(jnp.float32), y).mean()
            return jamp.scale_loss(loss, opt_state), (loss, updates["batch_stats"])

        grads, (loss, new_stats) = jax.grad(scaled_loss, has_aux=True)(params)
        return grads, loss, new_stats

    return grads


def make_train_step(apply_fn: Callable, tx: optax.GradientTransformation) -> Callable:
    """One optimizer step on a batch: `step(state, x, y) -> (state, loss)`, not yet jitted.

    `state` is `(params, batch_stats, opt_state)`. `tx.update` unscales the grads of
    `make_grads`, skips the step if they are not finite and, at O2, steps the float32 master
    weights.
    """
    grads_of = make_grads(apply_fn)

    def step(state, x, y):
        params, batch_stats, opt_state = state
        grads, loss, new_stats = grads_of(state, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        # A skipped step (grads not finite) leaves the running statistics as they were, too.
        finite = opt_state.last_finite  # the same field at every level
        new_stats = jax.tree_util.tree_map(lambda new, old: jnp.where(finite, new, old),
                                           new_stats, batch_stats)
        return (params, new_stats, opt_state), loss

    return step


def accuracy(apply_fn: Callable, state, x: np.ndarray, y: np.ndarray) -> float:
    """Test accuracy with BatchNorm's running averages."""
    params, batch_stats, _ = state
    logits = jax.jit(lambda p, s, x: apply_fn({"params": p, "batch_stats": s}, x,
                                              train=False))(params, batch_stats, x)
    return float(np.mean(np.argmax(np.asarray(logits), -1) == y))


def dtype_summary(state: tuple) -> dict[str, str]:
    """The dtypes of the conv and dense params ("kernels"), the BatchNorm params, the batch
    statistics and the optimizer's master weights (the params themselves where it keeps
    none)."""
    params, batch_stats, opt_state = state

    def names(tree, keep=lambda path: True):
        return ",".join(sorted({str(leaf.dtype) for path, leaf in
                                jax.tree_util.tree_leaves_with_path(tree) if keep(path)}))

    # A BatchNorm's params are those of a module that keeps batch statistics.
    is_bn = lambda path: path[0].key in batch_stats
    return {"kernels": names(params, lambda p: not is_bn(p)),
            "BatchNorm params": names(params, is_bn),
            "batch stats": names(batch_stats),
            "masters": names(jamp.master_params(opt_state, params))}


def matmul_dtypes(step: Any, *args) -> str:
    """The dtypes the convs and matmuls of the jitted `step` compute in (forward and backward),
    read from its lowered program: "f16 x8" is eight ops with float16 operands."""
    text = step.lower(*args).as_text()
    counts = collections.Counter(m.group(1) for m in map(_CONV_OR_MATMUL.search,
                                                          text.splitlines()) if m)
    return ",".join(f"{dtype} x{n}" for dtype, n in sorted(counts.items()))


# Compiled once for all runs (eagerly, each op of the init would compile on its own).
_init = jax.jit(lambda key, x: CNN().init(key, x, train=False))


def setup(level: str, data: dict[str, np.ndarray], *, lr: float = 3e-3, seed: int = 0,
          verbosity: int = 0) -> tuple[Callable, optax.GradientTransformation, tuple]:
    """The CNN initialised from `seed` and set up by `jamp.initialize` at `level`.

    Returns:
      `(apply_fn, tx, state)`: the amp apply function and optimizer `jamp.initialize` returned,
      and the training state `(params, batch_stats, opt_state)`.
    """
    model = CNN()
    variables = _init(jax.random.key(seed), data["x_train"][:1])
    apply_fn, variables, tx = jamp.initialize(model.apply, variables, optax.adam(lr),
                                              opt_level=level, verbosity=verbosity)
    params = variables["params"]
    return apply_fn, tx, (params, variables["batch_stats"], jax.jit(tx.init)(params))


def train(level: str, data: dict[str, np.ndarray], *, steps: int = 300, batch_size: int = 64,
          lr: float = 3e-3, seed: int = 0, verbosity: int = 0,
          jit: Callable = jax.jit, place: Callable = lambda tree: tree,
          feed: Callable = lambda *batch: batch) -> dict[str, Any]:
    """Trains the CNN at `level` from the initialisation of `seed` on the batches of `seed`.

    Args:
      level: an Apex opt level, "O0" to "O3".
      data: what `load_data` returns.
      steps, batch_size, lr, seed: the run; the same seed gives the same init and batches.
      verbosity: `jamp.initialize`'s (1 prints Apex's "Selected optimization level" block).
      jit: how to compile the step (`data_parallel.py` passes `jax.jit` with shardings).
      place: applied to the initial `(params, batch_stats, opt_state)` before training.
      feed: applied to each batch's `(images, labels)` (numpy arrays) before the step.

    Returns:
      A dict: `level`, `lr`, `apply_fn` and `tx` (what `jamp.initialize` returned), `step`
      (the compiled step), `initial` and `state` (`(params, batch_stats, opt_state)` before
      `place` and after training), `losses` (per step, float32), `dtypes` (`dtype_summary`'s
      and the convs' and matmuls'), `accuracy` (test), `skipped`,
      `largest` (the largest |param| after training), `seconds` (training, compiling
      included).
    """
    apply_fn, tx, initial = setup(level, data, lr=lr, seed=seed, verbosity=verbosity)
    dtypes = dtype_summary(initial)
    state = place(initial)
    step = jit(make_train_step(apply_fn, tx))
    order = batch_order(len(data["y_train"]), batch_size, steps, seed)
    dtypes["convs, matmuls"] = matmul_dtypes(
        step, state, *feed(data["x_train"][order[0]], data["y_train"][order[0]]))

    start = time.perf_counter()
    losses = []
    for idx in order:
        state, loss = step(state, *feed(data["x_train"][idx], data["y_train"][idx]))
        losses.append(loss)
    losses = np.asarray(jax.device_get(losses), np.float32)
    seconds = time.perf_counter() - start
    return dict(level=level, lr=lr, apply_fn=apply_fn, tx=tx, step=step, initial=initial,
                state=state, losses=losses, dtypes=dtypes, seconds=seconds,
                skipped=int(state[2].skipped_steps),
                accuracy=accuracy(apply_fn, state, data["x_test"], data["y_test"]),
                largest=max(float(np.max(np.abs(np.asarray(p, np.float32))))
                            for p in jax.tree_util.tree_leaves(state[0])))


def conclusions(results: list[dict[str, Any]], num_test: int) -> list[str]:
    """What the runs show, worded from what they measured."""
    by_level = {r["level"]: r for r in results}
    acc = {level: r["accuracy"] for level, r in by_level.items()}
    learned = [level for level, a in acc.items() if a > 0.5]  # chance is 10%
    lines = [f"{'Every level' if len(learned) == len(acc) else 'Only ' + ', '.join(learned)} "
             f"learned (chance is 10%): test accuracy from {min(acc.values()):.1%} to "
             f"{max(acc.values()):.1%} over {num_test} test images."]
    if "O0" in acc:
        for level in (lv for lv in acc if lv != "O0"):
            right = round((acc[level] - acc["O0"]) * num_test)
            lines.append(f"  {level}: {acc[level]:.1%}, {right:+d} test images right against "
                         f"float32 (O0), {100 * (acc[level] - acc['O0']):+.1f} points.")
    if "O2" in by_level:
        d = by_level["O2"]["dtypes"]
        lines.append(f"At O2 the convs and matmuls ran in {d['convs, matmuls']} while the "
                     f"BatchNorm params and statistics stayed {d['BatchNorm params']} "
                     f"(keep_batchnorm_fp32) and Adam stepped {d['masters']} master weights.")
    if "O3" in by_level and "O0" in by_level:
        o3, o0 = by_level["O3"]["largest"], by_level["O0"]["largest"]
        if o3 > 10 * o0:
            lines.append(
                f"At O3 (pure float16, no master weights) the largest |param| grew to {o3:.4g} "
                f"against {o0:.3g} at O0: Adam keeps its second moment in the params' float16, "
                f"where (1 - b2) * g**2 flushes to zero for |g| below about 8e-3, and a weight "
                f"with such grads steps by lr * m / eps. O2's float32 masters keep Adam in "
                f"float32; Apex offers O3 as a speed baseline, not a recipe.")
    if jax.default_backend() == "cpu":
        lines.append("On a CPU, XLA emulates float16 arithmetic, so the half-precision levels "
                     "are no faster here; on a GPU they are the fast path.")
    return lines


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--levels", nargs="+", default=list(LEVELS), choices=LEVELS)
    parser.add_argument("--verbosity", type=int, default=0,
                        help="1 prints jamp.initialize's 'Selected optimization level' block")
    args = parser.parse_args(argv)

    data = load_data()
    print(f"jax {jax.__version__} on {jax.default_backend()}: {len(data['y_train'])} train and "
          f"{len(data['y_test'])} test digits; {args.steps} Adam steps of {args.batch} images "
          f"per opt level, same init, same batches\n")
    results = []
    for level in args.levels:
        results.append(train(level, data, steps=args.steps, batch_size=args.batch, lr=args.lr,
                             verbosity=args.verbosity))

    print(f"{'level':5s} {'kernels':8s} {'BN params':9s} {'BN stats':8s} {'masters':8s} "
          f"{'convs+matmuls':13s} {'loss 1st':>8s} {'last 20':>7s} {'skipped':>7s} "
          f"{'max|param|':>10s} {'test acc':>8s} {'train s':>7s}")
    for r in results:
        d = r["dtypes"]
        print(f"{r['level']:5s} {d['kernels']:8s} {d['BatchNorm params']:9s} "
              f"{d['batch stats']:8s} {d['masters']:8s} {d['convs, matmuls']:13s} "
              f"{r['losses'][0]:8.4f} {r['losses'][-20:].mean():7.4f} {r['skipped']:7d} "
              f"{r['largest']:10.4g} {r['accuracy']:8.2%} {r['seconds']:7.1f}")
    print("\n'last 20' is the mean loss of the last 20 steps (ln 10 = 2.30 is a uniform guess); "
          "chance accuracy is 10%. 'train s' includes compiling the step.")
    for line in conclusions(results, len(data["y_test"])):
        print(line)
    return results


if __name__ == "__main__":
    main()
