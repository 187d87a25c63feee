"""Data-parallel O2 training on 8 devices with `jax.sharding`, equal to the single-device run.

The CNN of `cnn_digits.py` is trained at O2 on a `Mesh` over all of `jax.devices()` with one
axis, "data". Nothing in the training step changes: it is the same function, compiled by
`jax.jit` with the batch sharded along "data" (each device holds 1/8 of the images) and the
params, BatchNorm statistics and optimizer state (float32 masters and loss scale included)
replicated. XLA inserts the all-reduces, so the loss, the grads and BatchNorm's batch
statistics are over the global batch, as on one device.

Two comparisons with the single-device run, from the same initialisation on the same batches:

1. Step by step: along the single-device run, every step is also computed on the 8 devices
   from the same state, and what data parallelism computes is compared with `np.allclose`:
   the loss, the grads, the updated batch statistics, and the loss scale and skipped steps.
2. Whole runs: each trains on its own; their losses and test accuracies are compared.

The tolerances, and why they are float16's, not float32's: at O2 the grads of the float16
weights are float16 sums over the batch. On 8 devices each device's partial sum is rounded to
float16 and the 8 partials are added in float16 by the all-reduce (as Apex's DDP all-reduces
half grads), a few roundings of 2**-11 each, relative to partial sums that can be larger than
the total; and in the forward pass, BatchNorm's float32 statistics summed in another order
move a few float16 activations to the neighbouring float16 value. Hence each grad leaf is
held to 2**-7 of its largest element (atol), the loss to rtol 1e-4 with atol 1e-4, the
float32 batch statistics to rtol 1e-5 with atol 1e-6 (float32 sums reordered), and the loss
scale and skipped steps exactly.

The masters are not held to a tolerance, and the script says why with what it measures: Adam
turns every grad into a step of about `lr` whatever its size (at the first step exactly
`lr * sign(grad)`), so a weight whose grad is zero up to rounding steps by `+lr` in one run and
`-lr` in the other. Over a whole run such differences compound, as any rounding difference
does in training, so the whole runs are compared by what they learn.

On a CPU the 8 devices come from `XLA_FLAGS=--xla_force_host_platform_device_count=8`, which
must be set before jax starts: this script sets it when it is not set. README.md
("Multi-host training") shows how the same script runs on several hosts (`--distributed`).
"""

from __future__ import annotations

import os

_DEVICES_FLAG = "--xla_force_host_platform_device_count"
if _DEVICES_FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_DEVICES_FLAG}=8".strip()

import argparse  # noqa: E402
import functools  # noqa: E402
from typing import Any, Callable  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import jamp  # noqa: E402
from cnn_digits import batch_order, load_data, make_grads, train  # noqa: E402

# np.allclose(data_parallel, single_device, rtol, atol) for each step; "grads" compares each
# leaf divided by its largest single-device element (the module docstring says why).
TOLERANCES = {"loss": dict(rtol=1e-4, atol=1e-4),
              "grads / leaf's largest": dict(rtol=0.0, atol=2.0**-7),
              "BatchNorm statistics": dict(rtol=1e-5, atol=1e-6),
              "loss scale, skipped steps": dict(rtol=0.0, atol=0.0)}


def data_parallel(mesh: Mesh) -> tuple[Callable, Callable, Callable]:
    """`train`'s `jit`, `place` and `feed` for `mesh`: batches sharded along "data", the state
    replicated.

    Written for several hosts as for one: every process holds the same initial state (the same
    seed) and computes the same global batch (the same seed), and hands JAX only what its own
    devices hold, through `jax.make_array_from_process_local_data`. With one process that is
    everything.
    """
    replicated = NamedSharding(mesh, P())
    by_batch = NamedSharding(mesh, P("data"))

    def jit(step):  # for step(state, images, labels)
        compiled = jax.jit(step, in_shardings=(replicated, by_batch, by_batch),
                           out_shardings=replicated)

        # One step in flight at a time, for XLA's CPU devices: each device's part of a step
        # runs as a task on one shared thread pool and waits in the all-reduce, holding its
        # thread, until all the parts arrive. With steps dispatched ahead (JAX dispatches
        # asynchronously) on busy cores, a part missed XLA's 40-second rendezvous deadline,
        # which aborts the process, in 1 run of 3 run side by side; waiting for each step
        # made 9 of 9 pass. It costs nothing measurable here.
        @functools.wraps(step)
        def one_at_a_time(*args):
            return jax.block_until_ready(compiled(*args))

        one_at_a_time.lower = compiled.lower
        return one_at_a_time

    def place(tree):  # a replica's local data is the whole array
        return jax.tree_util.tree_map(
            lambda a: jax.make_array_from_process_local_data(replicated, np.asarray(a)), tree)

    def feed(*batch):  # this process's rows of the global batch
        mine = lambda a: np.array_split(a, jax.process_count())[jax.process_index()]
        return tuple(jax.make_array_from_process_local_data(by_batch, mine(a)) for a in batch)

    return jit, place, feed


def _worst(ref: Any, ours: Any, rtol: float, atol: float, per_leaf: bool = False):
    """The largest |ours - ref| and the largest fraction of what `np.allclose(ours, ref, rtol,
    atol)` allows (at most 1 when allclose), over the leaves; with `per_leaf`, each leaf pair
    is first divided by the largest |element| of the `ref` leaf."""
    diff_max, ratio_max = 0.0, 0.0
    for a, b in zip(jax.tree_util.tree_leaves(ref), jax.tree_util.tree_leaves(ours),
                    strict=True):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        if per_leaf:
            top = np.max(np.abs(a), initial=0.0) or 1.0
            a, b = a / top, b / top
        diff = np.abs(a - b)
        allowed = atol + rtol * np.abs(a)
        ratio = np.where(diff == 0, 0.0, diff / np.where(allowed > 0, allowed, np.inf))
        ratio = np.where((diff > 0) & (allowed == 0), np.inf, ratio)
        diff_max = max(diff_max, float(diff.max(initial=0.0)))
        ratio_max = max(ratio_max, float(ratio.max(initial=0.0)))
    return diff_max, ratio_max


def stepwise(single: dict, parallel: dict, jit: Callable, place: Callable, feed: Callable,
             data: dict, *, steps: int, batch_size: int, seed: int = 0) -> dict[str, Any]:
    """Computes each step of the single-device run `single` also on the mesh, from the same
    state, and compares them.

    Returns:
      `worst`: for each of `TOLERANCES`' keys, the largest |difference| over all steps and the
      largest fraction of what `np.allclose` allows; `master_step`: the largest difference
      between the float32 masters after the two steps, and `sign_flips`: how many of those
      master differences beyond `lr / 2` came with grads of opposite signs.
    """
    grads_of = make_grads(single["apply_fn"])
    one_grads, many_grads = jax.jit(grads_of), jit(grads_of)
    one_step, many_step, state = single["step"], parallel["step"], single["initial"]
    lr = single["lr"]
    worst = {name: (0.0, 0.0) for name in TOLERANCES}
    master_step, sign_flips = 0.0, 0
    for idx in batch_order(len(data["y_train"]), batch_size, steps, seed):
        x, y = data["x_train"][idx], data["y_train"][idx]
        grads, loss, stats = one_grads(state, x, y)
        ours = many_grads(place(state), *feed(x, y))
        new8, _ = many_step(place(state), *feed(x, y))
        state, _ = one_step(state, x, y)
        s1, s8 = state[2], new8[2]
        pairs = {"loss": (loss, ours[1]), "grads / leaf's largest": (grads, ours[0]),
                 "BatchNorm statistics": (stats, ours[2]),
                 "loss scale, skipped steps": ((s1.loss_scale, s1.skipped_steps),
                                               (s8.loss_scale, s8.skipped_steps))}
        for name, (ref, other) in pairs.items():
            new = _worst(ref, other, **TOLERANCES[name], per_leaf=name.startswith("grads"))
            worst[name] = tuple(max(o, n) for o, n in zip(worst[name], new))
        for m1, m8, g1, g8 in zip(*(jax.tree_util.tree_leaves(t) for t in (
                jamp.master_params(state[2]), jamp.master_params(new8[2]), grads, ours[0]))):
            diff = np.abs(np.asarray(m1, np.float64) - np.asarray(m8, np.float64))
            master_step = max(master_step, float(diff.max(initial=0.0)))
            flipped = np.sign(np.asarray(g1, np.float32)) != np.sign(np.asarray(g8, np.float32))
            sign_flips += int(np.sum((diff > lr / 2) & flipped))
    return dict(worst=worst, master_step=master_step, sign_flips=sign_flips)


def all_reduces(result: dict, feed: Callable, data: dict, batch_size: int) -> list[str]:
    """The element types each all-reduce of the compiled data-parallel step carries."""
    batch = feed(data["x_train"][:batch_size], data["y_train"][:batch_size])
    text = result["step"].lower(result["state"], *batch).compile().as_text()
    found = []
    for line in text.splitlines():
        if " all-reduce(" in line or " all-reduce-start(" in line:
            carried = line.split("=", 1)[1].split("all-reduce", 1)[0]
            found.append(",".join(sorted({t for t in ("f16", "f32", "bf16")
                                          if f"{t}[" in carried})))
    return found


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=64, help="global batch, over all devices")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--distributed", action="store_true",
                        help="one process per host: call jax.distributed.initialize() first "
                             "(README.md, 'Multi-host training')")
    parser.add_argument("--coordinator-address", help="jax.distributed.initialize's; leave "
                        "these three out where JAX detects the cluster (SLURM, Open MPI, TPU)")
    parser.add_argument("--num-processes", type=int)
    parser.add_argument("--process-id", type=int)
    args = parser.parse_args(argv)
    if args.distributed:
        jax.distributed.initialize(args.coordinator_address, args.num_processes,
                                   args.process_id)

    devices = jax.devices()
    if len(devices) < 2 or args.batch % len(devices):
        raise SystemExit(f"needs 2 or more devices dividing the batch ({args.batch}); found "
                         f"{len(devices)}. On a CPU, set XLA_FLAGS={_DEVICES_FLAG}=8 before "
                         f"jax is imported (this script does so when it is imported first).")
    mesh = Mesh(np.array(devices), ("data",))
    data = load_data()
    run = dict(steps=args.steps, batch_size=args.batch, seed=args.seed)
    print(f"jax {jax.__version__}: {len(devices)} {devices[0].platform} devices of "
          f"{jax.process_count()} process(es) in a mesh {dict(mesh.shape)}; O2, {args.steps} "
          f"Adam steps of {args.batch} images ({args.batch // len(devices)} per device)\n")

    single = train("O2", data, lr=args.lr, **run)
    jit, place, feed = data_parallel(mesh)
    parallel = train("O2", data, lr=args.lr, jit=jit, place=place, feed=feed, **run)
    kernel = parallel["state"][0]["Conv_0"]["kernel"]
    reduces = all_reduces(parallel, feed, data, args.batch)
    print(f"the state after training: {kernel.sharding.spec} on {len(kernel.devices())} devices "
          f"(fully replicated: {kernel.sharding.is_fully_replicated}); each batch: "
          f"{NamedSharding(mesh, P('data')).spec}")
    print(f"the compiled step's all-reduces carry: {', '.join(reduces)}\n")

    check = stepwise(single, parallel, jit, place, feed, data, **run)
    worst = check["worst"]
    print(f"1. Step by step ({args.steps} steps, each from the same state on 1 and on "
          f"{len(devices)} devices):")
    print(f"   {'':26s} {'largest |diff|':>14s} {'of allowed':>10s}   np.allclose tolerance")
    for name, (diff, ratio) in worst.items():
        tol = TOLERANCES[name]
        print(f"   {name:26s} {diff:14.3g} {ratio:10.2f}   rtol={tol['rtol']:.3g}, "
              f"atol={tol['atol']:.3g}")
    equal = all(ratio <= 1.0 for _, ratio in worst.values())
    print(f"   then Adam's step: the float32 masters differ by up to {check['master_step']:.3g} "
          f"({check['master_step'] / args.lr:.2f} lr); {check['sign_flips']} weight(s) moved "
          f"more than lr/2 apart where the two grads had opposite signs")

    tail1, tail8 = single["losses"][-20:].mean(), parallel["losses"][-20:].mean()
    drift = max(float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b))))
                for a, b in zip(jax.tree_util.tree_leaves(jamp.master_params(single["state"][2])),
                                jax.tree_util.tree_leaves(
                                    jamp.master_params(parallel["state"][2]))))
    print(f"\n2. Whole runs:  {'1 device':>10s} {f'{len(devices)} devices':>10s}")
    print(f"   first loss     {single['losses'][0]:10.4f} {parallel['losses'][0]:10.4f}")
    print(f"   last 20 loss   {tail1:10.4f} {tail8:10.4f}")
    print(f"   test accuracy  {single['accuracy']:10.2%} {parallel['accuracy']:10.2%}")
    print(f"   skipped steps  {single['skipped']:10d} {parallel['skipped']:10d}")
    print(f"   train seconds  {single['seconds']:10.1f} {parallel['seconds']:10.1f}   "
          "(compiling included)")
    print(f"   after {args.steps} steps the masters differ by up to {drift:.3g}\n")

    if equal:
        print(f"In every one of the {args.steps} steps the {len(devices)}-device loss, grads and "
              f"batch statistics equal the single-device ones within float16's rounding (at "
              f"most {max(r for _, r in worst.values()):.2f} of the tolerances above), with the "
              "same loss scale and skipped steps: sharding the batch changed where the work "
              "ran, not what the step computes.")
    else:
        print("A data-parallel step DIFFERS from the single-device step beyond the tolerances "
              "above.")
    if check["sign_flips"]:
        print(f"Adam's steps differ more: a grad that is zero up to rounding has a sign set by "
              f"the rounding, and Adam steps it by about lr either way ({check['sign_flips']} "
              f"such weight-steps, up to {check['master_step'] / args.lr:.2f} lr apart).")
    gap = 100 * abs(parallel["accuracy"] - single["accuracy"])
    print(f"The two whole runs end {gap:.1f} points apart in test accuracy "
          f"({single['accuracy']:.1%} and {parallel['accuracy']:.1%}): their step differences "
          f"compound over {args.steps} steps (the masters end {drift:.2g} apart), as any change "
          f"in rounding does.")
    if devices[0].platform == "cpu":
        print(f"On a CPU the {len(devices)} devices share the same cores, so the data-parallel "
              f"run is no faster here; on {len(devices)} accelerators each computes "
              f"1/{len(devices)} of the batch.")
    return dict(single=single, parallel=parallel, stepwise=check, equal=equal,
                all_reduces=reduces)


if __name__ == "__main__":
    main()
