"""Profile the demo's GPT training step: float32, under autocast, and hand-written half.

For each of the three steps (the same model, loss and batch) it prints what the AMP report reads
from the program (the share of matmul FLOPs in half precision, the casts and their bytes) and
what JAX's profiler measured (the time of a step, read from the trace), then torch's table of
the autocast step's ops. On a GPU the table has device (kernel) times; on the CPU, where XLA
emulates float16 and bfloat16 by rounding and computes in float32, it shows the casts that
emulation costs. `--out results.json` writes the numbers.

    python examples/profile_step.py                  # autocast float16
    python examples/profile_step.py --dtype bfloat16 --steps 20 --out profile.json
"""

from __future__ import annotations

import argparse
import json
import statistics

import jax
import jax.numpy as jnp

import jamp
from jamp.profile import amp_report, profile, record_function
from models import ByteGPT, next_byte_loss


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"])
    parser.add_argument("--steps", type=int, default=10, help="profiled calls of each step")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--rows", type=int, default=12, help="rows of the op table")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    return parser.parse_args(argv)


def grad_steps(args):
    """The three jitted grad steps and their (params, batch) arguments."""
    low = jnp.dtype(args.dtype)
    model = ByteGPT(width=args.width, depth=args.depth, max_len=args.seq)
    half_model = ByteGPT(width=args.width, depth=args.depth, max_len=args.seq, dtype=low)
    windows = jax.random.randint(jax.random.PRNGKey(1), (args.batch, args.seq + 1), 0, 256)
    params = model.init(jax.random.PRNGKey(0), windows[:, :-1])

    def loss(apply):
        def fn(params, windows):
            logits = apply(params, windows[:, :-1]).astype(jnp.float32)
            return next_byte_loss(logits, windows)
        return fn

    def float32_step(params, windows):
        return jax.grad(loss(model.apply))(params, windows)

    def autocast_step(params, windows):
        return jax.grad(jamp.autocast(loss(model.apply), dtype=low))(params, windows)

    def half_step(params, windows):  # Flax's own dtype=: float32 params, half compute
        return jax.grad(loss(half_model.apply))(params, windows)

    steps = {"float32": float32_step, f"autocast {args.dtype}": autocast_step,
             f"hand-written {args.dtype}": half_step}
    return {name: jax.jit(fn) for name, fn in steps.items()}, (params, windows)


def step_time_us(prof, program: str) -> float:
    """The median time of a run of `program` in the trace: its kernels' time on a device,
    the span of its ops on the CPU."""
    runs = [e for e in prof.events() if e.kind == "program" and e.key == program]
    times = [e.device_time_total if e.device_time_total else e.cpu_time_total for e in runs]
    return statistics.median(times) if times else float("nan")


def main(argv=None) -> dict:
    args = parse_args(argv)
    steps, arguments = grad_steps(args)
    device = jax.devices()[0]
    print(f"jax {jax.__version__} on {device.platform} ({device.device_kind}); "
          f"{args.steps} profiled calls per step\n")
    results, profiles = {}, {}
    for name, step in steps.items():
        report = amp_report(step, *arguments)
        jax.block_until_ready(step(*arguments))  # compile outside the profile
        with profile(record_shapes=True, with_flops=True) as prof:
            for _ in range(args.steps):
                with record_function(name):
                    jax.block_until_ready(step(*arguments))
        program = f"jit_{step.__name__}"
        results[name] = {
            "half_flops_fraction": report.half_flops_fraction,
            "converts": sum(c.count for c in report.converts),  # executed, as the bytes are
            "convert_bytes": sum(c.bytes for c in report.converts),
            "step_time_us": step_time_us(prof, program),
            "device": prof.device_name or "cpu",
        }
        profiles[name] = (prof, report)

    baseline = results["float32"]["step_time_us"]
    width = max(map(len, results)) + 2
    print(f"{'step':<{width}}{'half FLOPs':>11}{'converts':>10}{'convert bytes':>15}"
          f"{'step time':>12}{'vs float32':>12}")
    for name, r in results.items():
        r["ratio_to_float32"] = r["step_time_us"] / baseline
        print(f"{name:<{width}}{r['half_flops_fraction']:>11.2f}{r['converts']:>10}"
              f"{r['convert_bytes'] / 2**20:>12.2f} MB{r['step_time_us'] / 1e3:>10.3f}ms"
              f"{r['ratio_to_float32']:>11.2f}x")

    autocast_name = f"autocast {args.dtype}"
    prof, report = profiles[autocast_name]
    has_device = prof.device_name is not None
    sort_by = "self_device_time_total" if has_device else "self_cpu_time_total"
    print(f"\nThe {autocast_name} step's ops, by {sort_by}:")
    print(prof.key_averages().table(sort_by=sort_by, row_limit=args.rows))
    print(f"The AMP report of the {autocast_name} step:")
    print(report.table(row_limit=8))
    if not has_device:
        print("On the CPU XLA rounds float16/bfloat16 values and multiplies in float32, so the "
              "half steps pay for casts without faster matmuls: run this on a GPU for the "
              "speed-up.")
    if args.out:
        with open(args.out, "w") as file:
            json.dump({"args": vars(args), "results": results,
                       "table": prof.key_averages().table(sort_by=sort_by, row_limit=40)},
                      file, indent=2)
    return {"results": results, "profiles": profiles}


if __name__ == "__main__":
    main()
