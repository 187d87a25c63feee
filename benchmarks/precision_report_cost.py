"""What a precision report costs: `jamp.debug.precision_report` over one batch of the demo's
byte-level GPT (examples/models.py), against one float32 training step of the same model.

A report runs once, when a run goes wrong: its cost is the whole call, tracing and compiling
its program (the autocast program and its backward pass, a float32 shadow beside them, and
the measurements) included. So the step is timed the same way, cold: a fresh `jax.jit` of the
float32 value-and-grad step, traced, compiled and run once. Both are timed interleaved, round
by round, and the ratio is the median of the per-round ratios (see common.py). The steady
time of the compiled step is printed beside, for scale.

Run: python benchmarks/precision_report_cost.py [--quick]
"""

from __future__ import annotations

import argparse
import pathlib
import random
import sys
import time

import jax
import jax.numpy as jnp

from common import block_until_ready, print_ratios

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))

from models import ByteGPT, next_byte_loss  # noqa: E402

from jamp.debug import precision_report  # noqa: E402

TARGET = 3.0


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds, a smaller model")
    args = parser.parse_args()
    rounds = 1 if args.quick else 5
    width, depth = (32, 1) if args.quick else (128, 2)
    batch, seq = (4, 32) if args.quick else (16, 64)

    model = ByteGPT(width=width, depth=depth)
    windows = jax.random.randint(jax.random.key(0), (batch, seq + 1), 0, 256)
    params = jax.jit(model.init)(jax.random.key(1), windows[:, :-1])["params"]

    def loss(params, windows):
        logits = model.apply({"params": params}, windows[:, :-1])
        return next_byte_loss(logits.astype(jnp.float32), windows)

    def step_cold():
        # A new function each time: jax.jit traces and compiles it afresh.
        return block_until_ready(jax.jit(lambda p, w: jax.value_and_grad(loss)(p, w))(
            params, windows))

    reports = []

    def report():
        reports.append(precision_report(loss, params, windows, dtype=jnp.float16,
                                        device_type="cuda"))
        return reports[-1]

    candidates = {"float32 step (trace, compile, run)": step_cold,
                  "precision_report (float16)": report}
    samples = {name: [] for name in candidates}
    order = random.Random(0)
    names = list(candidates)
    for fn in candidates.values():
        fn()  # imports, first-use caches
    for _ in range(rounds):
        order.shuffle(names)
        for name in names:
            start = time.perf_counter()
            candidates[name]()
            samples[name].append(time.perf_counter() - start)

    compiled = jax.jit(jax.value_and_grad(loss))
    block_until_ready(compiled(params, windows))
    start = time.perf_counter()
    for _ in range(10):
        out = compiled(params, windows)
    block_until_ready(out)
    steady = (time.perf_counter() - start) / 10

    print(f"jax {jax.__version__} on {jax.default_backend()}; ByteGPT width {width}, depth "
          f"{depth}; batch {batch}x{seq}; {rounds} rounds\n")
    print_ratios("Seconds per call, and the ratio over the cold float32 step:", samples,
                 "float32 step (trace, compile, run)",
                 targets={"precision_report (float16)": TARGET})
    print(f"\nthe compiled float32 step alone runs in {steady * 1e3:.3f} ms; the report's "
          f"summary: {reports[-1].summary()}")


if __name__ == "__main__":
    main()
