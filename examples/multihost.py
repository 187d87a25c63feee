"""The demo's byte-level GPT trained data-parallel over every process's devices, resumable after a
crash.

One program, run once per host (JAX's multi-controller model): after `jax.distributed.initialize`
every process sees the devices of all hosts, the mesh spans them, and the training step, compiled
once by `jax.jit` with shardings, runs on all of them, XLA inserting the collectives. jamp needs
nothing more: the loss scaler's finiteness check and the master weights' update are part of that
one program, so every process makes the same skip decision and keeps the same loss scales.

What is trained (`--amp`): `jamp.initialize(model.apply, variables, optax.adamw(lr),
opt_level="O2")` (float16 params, float32 master weights, Apex's dynamic loss scale; or another
opt level), or the model under `jamp.autocast(dtype=jnp.bfloat16)` with a `loss_scaled` AdamW
(the demo's last run). The loss is the next-byte cross-entropy plus a small z-loss (the square
of the logits' log normalizer, which keeps them from drifting); `--num-losses 2` gives each its
own loss scale (Apex's `num_losses`). `--state fsdp` shards the params, the master weights and
the optimizer moments over the "data" axis (FSDP) instead of replicating them.

Each process hands JAX only its part of the data, through `jax.make_array_from_process_local_data`.
The batch of a step depends on the step alone, so a run that resumes from a checkpoint
(`--checkpoint-dir`: `jamp.save_checkpoint` with orbax, asynchronously, every
`--checkpoint-every` steps) continues exactly as if it had not stopped.

Launch (docs/distributed.md has the details):

    # one process per host where JAX detects the cluster (SLURM's srun, Open MPI, Cloud TPU,
    # Kubernetes with JobSet): nothing else to give
    python examples/multihost.py --distributed
    # elsewhere, on host i of N, the coordinator being process 0's host and a free port
    python examples/multihost.py --distributed --coordinator-address host0:1234 \\
        --num-processes N --process-id i
    # N processes on this machine, each with its own CPU devices (what the tests run)
    python examples/multihost.py --local-processes 2 --devices-per-process 4

For the tests, two faults: `--inject-inf STEP:ROW` makes the loss weight of window ROW of the
global batch infinite at step STEP (in the part of the process that holds that row), and
`--crash-at STEP[:PROCESS]` makes that process (or each) kill itself with SIGKILL after that
step, right after its checkpoint's save started (no clean-up, as when a host dies). `--report`
writes what each process saw, step by step, as JSON lines.
"""

from __future__ import annotations

import os

_DEVICES_FLAG = "--xla_force_host_platform_device_count"
if _DEVICES_FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_DEVICES_FLAG}=8".strip()

import argparse  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from typing import Any, Callable  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # noqa: E402

import jamp  # noqa: E402
from models import ByteGPT, next_byte_loss  # noqa: E402
from text_data import batch_at, load_corpus, split  # noqa: E402

Z_LOSS = 1e-4  # weight of the z-loss (PaLM's)


def fsdp_shardings(tree: Any, mesh: jax.sharding.Mesh, axis: str = "data") -> Any:
    """A `NamedSharding` per leaf of `tree`: split along `axis` on the leaf's largest dimension
    that `axis` divides (FSDP), replicated where none does (scalars: counters, loss scales)."""
    size = mesh.shape[axis]

    def sharding(leaf):
        shape = np.shape(leaf)
        dims = [d for d in np.argsort(shape)[::-1] if shape[d] % size == 0 and shape[d] >= size]
        spec = [None] * len(shape)
        if dims:
            spec[dims[0]] = axis
        return NamedSharding(mesh, P(*spec))

    return jax.tree_util.tree_map(sharding, tree)


def setup(args, mesh) -> tuple[Callable, optax.GradientTransformation, dict, Any]:
    """The model's amp apply function and optimizer, the initial state `{"params",
    "opt_state", "step"}` placed on `mesh`, and the state's shardings."""
    model = ByteGPT(width=args.width, depth=args.depth, max_len=args.seq)
    sample = np.zeros((1, args.seq), np.int32)
    variables = jax.jit(model.init)(jax.random.key(args.seed), sample)
    adamw = optax.adamw(args.lr)
    if args.amp != "autocast":
        apply_fn, variables, tx = jamp.initialize(model.apply, variables, adamw,
                                                  opt_level=args.amp,
                                                  num_losses=args.num_losses, verbosity=0)
    else:
        apply_fn = jamp.autocast(model.apply, dtype=jnp.bfloat16)
        tx = jamp.loss_scaled(adamw, jamp.DynamicLossScale(jnp.float32(2.0**15),
                                                           period=args.growth_interval),
                              num_losses=args.num_losses)
    params = variables["params"]
    state = {"params": params, "opt_state": jax.jit(tx.init)(params),
             "step": jnp.zeros([], jnp.int32)}
    if args.state == "fsdp":
        shardings = fsdp_shardings(state, mesh)
    else:
        shardings = jax.tree_util.tree_map(lambda _: NamedSharding(mesh, P()), state)
    # Every process built the same state from the same seed; each hands JAX its devices' part.
    state = jax.tree_util.tree_map(
        lambda x, s: jax.make_array_from_callback(x.shape, s, lambda index: np.asarray(x)[index]),
        state, shardings)
    return apply_fn, tx, state, shardings


def make_step(apply_fn: Callable, tx, num_losses: int) -> Callable:
    """`step(state, windows, weights) -> (state, loss)`: one AdamW step on the scaled losses."""

    def losses(params, windows, weights):
        logits = apply_fn({"params": params}, windows[:, :-1]).astype(jnp.float32)
        z_loss = Z_LOSS * jnp.mean(jax.nn.logsumexp(logits, axis=-1) ** 2)
        return next_byte_loss(logits, windows, weights), z_loss

    def step(state, windows, weights):
        params, opt_state = state["params"], state["opt_state"]
        if num_losses == 1:
            def scaled(p):
                loss = sum(losses(p, windows, weights))
                return jamp.scale_loss(loss, opt_state), loss
            grads, loss = jax.grad(scaled, has_aux=True)(params)
        else:
            # Each loss scaled by its own scale and differentiated on its own (Apex's backward
            # per loss): an overflow in one loss's grads leaves the other's scale alone.
            def scaled(p, k):
                parts = losses(p, windows, weights)
                return jamp.scale_loss(parts[k], opt_state, k), sum(parts)
            grads = []
            for k in range(num_losses):
                g, loss = jax.grad(scaled, has_aux=True)(params, k)
                grads.append(g)
        updates, opt_state = tx.update(grads, opt_state, params)
        return {"params": optax.apply_updates(params, updates), "opt_state": opt_state,
                "step": state["step"] + 1}, loss

    return step


def local_batch(args, train: np.ndarray, step: int) -> tuple[np.ndarray, np.ndarray]:
    """This process's rows of step `step`'s global batch, and their loss weights (ones, but for
    the window `--inject-inf` names)."""
    windows = batch_at(train, args.batch, args.seq, args.seed, step)
    weights = np.ones(args.batch, np.float32)
    if args.inject_inf and args.inject_inf[0] == step:
        weights[args.inject_inf[1] or 0] = np.inf
    rows = np.array_split(np.arange(args.batch), jax.process_count())[jax.process_index()]
    return windows[rows], weights[rows]


def scales_of(opt_state, num_losses: int) -> list[float]:
    return [float(jamp.get_loss_scale(opt_state, k).loss_scale) for k in range(num_losses)]


def digests(state: Any, replicated: NamedSharding) -> dict[str, str]:
    """Fingerprints of the state: `global` of the whole arrays (the same for any process count
    or mesh), `local` of the copies this process holds (replicated leaves: the same in every
    process exactly when the processes agree bit for bit)."""
    gathered = jax.jit(lambda tree: tree, out_shardings=replicated)(state)
    whole, local = hashlib.sha256(), hashlib.sha256()
    for full, array in zip(jax.tree_util.tree_leaves(gathered), jax.tree_util.tree_leaves(state)):
        whole.update(np.asarray(full.addressable_shards[0].data).tobytes())
        copies = sorted({(str(s.index), np.asarray(s.data).tobytes())
                         for s in array.addressable_shards})
        for index, data in copies:
            local.update(index.encode() + data)
    return {"global": whole.hexdigest(), "local": local.hexdigest()}


def train(args) -> dict[str, Any]:
    devices = jax.devices()
    if args.batch % len(devices):
        raise SystemExit(f"--batch {args.batch} must be a multiple of the {len(devices)} devices")
    # Auto axes: the model is the demo's unchanged Flax code, and XLA places the collectives.
    mesh = jax.make_mesh((len(devices),), ("data",), axis_types=(AxisType.Auto,))
    by_batch, replicated = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())
    apply_fn, tx, state, shardings = setup(args, mesh)
    step = jax.jit(make_step(apply_fn, tx, args.num_losses),
                   in_shardings=(shardings, by_batch, by_batch),
                   out_shardings=(shardings, replicated))
    train_bytes = split(load_corpus())[0]
    manager = None
    if args.checkpoint_dir:
        import orbax.checkpoint as ocp
        if devices[0].platform == "cpu":
            # orbax splits the writing of each replicated array among its replicas, slicing it
            # on the devices with one compiled slice per piece: for the many small arrays of a
            # replicated state on CPU devices, seconds of compiling per leaf shape. Each
            # array is written whole by one replica instead.
            ocp.type_handlers.register_type_handler(
                jax.Array, ocp.type_handlers.ArrayHandler(use_replica_parallel=False),
                override=True)
        manager = ocp.CheckpointManager(
            os.path.abspath(args.checkpoint_dir),
            options=ocp.CheckpointManagerOptions(save_interval_steps=args.checkpoint_every,
                                                 max_to_keep=2))
        if manager.latest_step() is not None:
            state = jamp.restore_checkpoint(manager, state)
    first = int(state["step"])
    me = jax.process_index()
    report = open(args.report.format(process=me), "a") if args.report else None
    if me == 0:
        print(f"jax {jax.__version__}: {len(devices)} {devices[0].platform} devices of "
              f"{jax.process_count()} process(es), mesh {dict(mesh.shape)}; {args.amp}, "
              f"{args.num_losses} loss scale(s), state {args.state}; steps {first} to "
              f"{args.steps}" + (f" (resumed from checkpoint {first})" if first else ""),
              flush=True)
    for i in range(first, args.steps):
        windows, weights = local_batch(args, train_bytes, i)
        scales = scales_of(state["opt_state"], args.num_losses)
        state, loss = step(state,
                           jax.make_array_from_process_local_data(by_batch, windows),
                           jax.make_array_from_process_local_data(by_batch, weights))
        record = dict(step=i, loss=float(loss), scales=scales,
                      applied=bool(state["opt_state"].last_finite),
                      skipped=int(state["opt_state"].skipped_steps))
        if report:
            report.write(json.dumps(record) + "\n")
            report.flush()
        if me == 0 and (i + 1) % args.log_every == 0:
            print(f"step {i + 1}: loss {record['loss']:.4f}, scale(s) {scales}, "
                  f"{record['skipped']} skipped", flush=True)
        if manager:
            jamp.save_checkpoint(manager, i + 1, state)
        if args.crash_at and args.crash_at[0] == i + 1 and args.crash_at[1] in (None, me):
            os.kill(os.getpid(), signal.SIGKILL)  # no clean-up, no waiting for the save
    if manager:
        manager.wait_until_finished()
    final = dict(final=True, step=int(state["step"]),
                 scales=scales_of(state["opt_state"], args.num_losses),
                 skipped=int(state["opt_state"].skipped_steps),
                 params=digests(state["params"], replicated),
                 masters=digests(jamp.master_params(state["opt_state"], state["params"]),
                                 replicated),
                 opt_state=digests(state["opt_state"], replicated))
    if report:
        report.write(json.dumps(final) + "\n")
        report.close()
    if me == 0:
        print(f"done: {final['skipped']} of {final['step']} steps skipped, loss scale(s) "
              f"{final['scales']}; params {final['params']['global'][:12]}", flush=True)
    return dict(final, state=state)


# --- N processes on this machine ----------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_local(argv: list[str], num_processes: int, devices_per_process: int, *,
              env: dict[str, str] | None = None, timeout: float = 600.0,
              attempts: int = 3) -> list[dict[str, Any]]:
    """Runs this script as one JAX job of `num_processes` processes on this machine, each with
    `devices_per_process` CPU devices, and waits for them.

    Each process is started with `--distributed` and the coordinator's address (a free port of
    127.0.0.1); a single process is started without (no coordinator). When one process fails or
    dies, the others are killed, as a cluster's scheduler ends a job whose process died; when the
    coordinator's port was taken meanwhile (another job starting at once), the job is started
    again on another port. `env` adds environment variables (JAX's settings, say) to this
    process's.

    Returns:
      Per process: `returncode` (-9 for SIGKILL), `stdout`, `stderr`.
    """
    for _ in range(attempts):
        results = _run_job(argv, num_processes, devices_per_process, _free_port(), env or {},
                           timeout)
        if not any("already in use" in r["stderr"].lower() for r in results):
            return results
    return results


def _run_job(argv, num_processes, devices_per_process, port, extra_env,
             timeout) -> list[dict[str, Any]]:
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(_DEVICES_FLAG)]
    env = dict(os.environ, **extra_env, JAX_PLATFORMS="cpu",
               XLA_FLAGS=" ".join(flags + [f"{_DEVICES_FLAG}={devices_per_process}"]))
    with tempfile.TemporaryDirectory() as logs:
        procs, files = [], []
        for i in range(num_processes):
            out = open(os.path.join(logs, f"{i}.out"), "w+")
            err = open(os.path.join(logs, f"{i}.err"), "w+")
            files.append((out, err))
            job = (["--distributed", "--coordinator-address", f"127.0.0.1:{port}",
                    "--num-processes", str(num_processes), "--process-id", str(i)]
                   if num_processes > 1 else [])
            procs.append(subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), *argv, *job], env=env, stdout=out,
                stderr=err, cwd=os.path.dirname(os.path.abspath(__file__))))
        deadline = time.monotonic() + timeout
        while None in (codes := [p.poll() for p in procs]):
            if any(codes) or time.monotonic() > deadline:
                for p, code in zip(procs, codes):
                    if code is None:
                        p.kill()
            time.sleep(0.05)
        results = []
        for p, (out, err) in zip(procs, files):
            out.seek(0)
            err.seek(0)
            results.append(dict(returncode=p.wait(), stdout=out.read(), stderr=err.read()))
            out.close()
            err.close()
        return results


# --- command line ------------------------------------------------------------------------------


def _step_and_index(text: str) -> tuple[int, int | None]:
    step, _, index = text.partition(":")
    return int(step), int(index) if index else None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    run = parser.add_argument_group("training")
    run.add_argument("--amp", choices=("O0", "O1", "O2", "O3", "autocast"), default="O2",
                     help="an opt level of jamp.initialize, or autocast (bfloat16) with a "
                          "loss_scaled AdamW")
    run.add_argument("--num-losses", type=int, choices=(1, 2), default=1,
                     help="2: the next-byte loss and the z-loss each with its own loss scale")
    run.add_argument("--state", choices=("replicated", "fsdp"), default="replicated",
                     help="params, master weights and optimizer state replicated, or sharded "
                          "over the devices")
    run.add_argument("--steps", type=int, default=200)
    run.add_argument("--batch", type=int, default=16, help="global batch, over all devices")
    run.add_argument("--seq", type=int, default=64)
    run.add_argument("--width", type=int, default=128)
    run.add_argument("--depth", type=int, default=2)
    run.add_argument("--lr", type=float, default=3e-3)
    run.add_argument("--growth-interval", type=int, default=50,
                     help="--amp autocast: finite steps before the loss scale doubles")
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--log-every", type=int, default=20)
    run.add_argument("--checkpoint-dir", help="save here, and resume from here when it holds a "
                     "checkpoint")
    run.add_argument("--checkpoint-every", type=int, default=10)
    run.add_argument("--report", help="per-process JSON lines; {process} is replaced")
    job = parser.add_argument_group("processes")
    job.add_argument("--distributed", action="store_true",
                     help="one process of a multi-process job: jax.distributed.initialize first")
    job.add_argument("--coordinator-address", help="jax.distributed.initialize's; leave these "
                     "three out where JAX detects the cluster (SLURM, Open MPI, Cloud TPU)")
    job.add_argument("--num-processes", type=int)
    job.add_argument("--process-id", type=int)
    job.add_argument("--local-processes", type=int,
                     help="start this many processes on this machine and wait for them; exit "
                          "non-zero when one failed")
    job.add_argument("--devices-per-process", type=int, default=4,
                     help="with --local-processes: CPU devices of each")
    faults = parser.add_argument_group("faults, for the tests")
    faults.add_argument("--inject-inf", type=_step_and_index, metavar="STEP:ROW",
                        help="an infinite loss weight for window ROW of the global batch "
                             "(in the part of the process that holds it) at step STEP")
    faults.add_argument("--crash-at", type=_step_and_index, metavar="STEP[:PROCESS]",
                        help="SIGKILL after step STEP (and its checkpoint's start), in process "
                             "PROCESS or in every one")
    return parser.parse_args(argv)


def _without(argv: list[str], *options: str) -> list[str]:
    """`argv` without `options` and their values (`--x 2` or `--x=2`)."""
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in options:
            skip = True
        elif not arg.startswith(tuple(f"{o}=" for o in options)):
            kept.append(arg)
    return kept


def main(argv: list[str] | None = None) -> Any:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.local_processes:
        each = _without(argv, "--local-processes", "--devices-per-process")
        results = run_local(each, args.local_processes, args.devices_per_process)
        for i, r in enumerate(results):
            print(f"--- process {i} (exit {r['returncode']}) ---\n{r['stdout']}", end="")
            if r["returncode"]:
                print(r["stderr"][-3000:], end="")
        codes = [r["returncode"] for r in results]
        if any(codes):
            # Exit non-zero, as any launcher does, so that a script or CI sees the job failed.
            raise SystemExit(f"the job failed: the processes exited with {codes}")
        return results
    if args.distributed:
        # The CPU backend's collectives across processes (GPUs and TPUs bring their own).
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(args.coordinator_address, args.num_processes,
                                   args.process_id)
    return train(args)


if __name__ == "__main__":
    main()
