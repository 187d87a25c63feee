"""What storing residuals in bfloat16 saves: `jamp.autograd.graph.save_as(jnp.bfloat16)` around
the loss of an activation-heavy float32 MLP, over the same loss without hooks.

Prints, for the jitted grad step, two ratios against a target of <= 0.6:
  * the bytes of the residuals saved for the backward pass: the array leaves of the pullback
    that `jax.vjp` returns for the loss (with the hooks, the packed values the custom_vjp
    stores), summed from their shapes and dtypes;
  * the compiled temp bytes of `jax.jit(jax.grad(loss))`, from XLA's memory analysis: what the
    compiler actually keeps, after its fusion and scheduling.
float8_e4m3fn storage is printed beside, without a target. Both figures are counts of bytes,
not timings: the same on every run of one backend. The compiled figure depends on the backend:
the CPU compiler fuses each cast to bfloat16 with the cast back (it drops the optimization
barrier jamp puts between them first), so there the compiled temp bytes do not shrink; the
script says so when it runs on the CPU.

Run: python benchmarks/residual_memory.py [--quick]
"""

from __future__ import annotations

import argparse
import math

import jax
import jax.numpy as jnp

from common import residual_bytes
from jamp.autograd.graph import save_as

TARGET = 0.6


def init_mlp(key, width: int, depth: int, ratio: int = 4):
    """`depth` blocks of Dense(width -> ratio * width), ReLU, Dense(-> width), float32."""
    params = []
    for k in jax.random.split(key, depth):
        k1, k2 = jax.random.split(k)
        params.append({
            "w1": jax.random.normal(k1, (width, ratio * width)) / math.sqrt(width),
            "w2": jax.random.normal(k2, (ratio * width, width)) / math.sqrt(ratio * width),
        })
    return params


def mlp_loss(params, x):
    """A residual ReLU MLP's mean squared output: its activations outweigh its weights."""
    for p in params:
        x = x + jax.nn.relu(x @ p["w1"]) @ p["w2"]
    return jnp.mean(x ** 2)


def temp_bytes(loss, *args) -> int:
    compiled = jax.jit(jax.grad(loss)).lower(*args).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def measure(args) -> dict[str, tuple[int, int]]:
    """(residual bytes, compiled temp bytes) of each candidate's grad step."""
    params = init_mlp(jax.random.key(0), args.width, args.depth)
    x = jax.random.normal(jax.random.key(1), (args.batch, args.width))
    losses = {
        "float32 (no hooks)": mlp_loss,
        "save_as(bfloat16)": save_as(jnp.bfloat16)(mlp_loss),
        "save_as(float8_e4m3fn)": save_as(jnp.float8_e4m3fn)(mlp_loss),
    }
    return {name: (residual_bytes(loss, params, x), temp_bytes(loss, params, x))
            for name, loss in losses.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small MLP, for a smoke run")
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--batch", type=int, default=4096)
    args = parser.parse_args()
    if args.quick:
        args.width, args.depth, args.batch = 128, 4, 512

    backend = jax.default_backend()
    print(f"jax {jax.__version__} on {backend}; ReLU MLP width {args.width} (hidden "
          f"{4 * args.width}), {args.depth} blocks, batch {args.batch}, float32")
    rows = measure(args)
    base_res, base_temp = rows["float32 (no hooks)"]
    print(f"\n  {'':28s} {'residuals':>12s} {'ratio':>7s} {'compiled temp':>14s} {'ratio':>7s}")
    for name, (res, temp) in rows.items():
        print(f"  {name:28s} {res / 2**20:8.2f} MiB  x{res / base_res:.3f}"
              f" {temp / 2**20:10.2f} MiB  x{temp / base_temp:.3f}")
    res, temp = rows["save_as(bfloat16)"]
    ratios = {"residual bytes": res / base_res, "compiled temp bytes": temp / base_temp}
    for what, ratio in ratios.items():
        verdict = "PASS" if ratio <= TARGET else "FAIL"
        print(f"save_as(bfloat16) over float32, {what}: x{ratio:.3f} "
              f"(target <= {TARGET:.2f}): {verdict}")
    if backend == "cpu":
        print("note: XLA's CPU compiler removes optimization barriers before it fuses, then "
              "fuses each float32 -> bfloat16 -> float32 round trip into one op with a float32 "
              "result: no bfloat16 buffer is kept, so its temp bytes do not shrink. The residual "
              "bytes are what the custom_vjp stores, on every backend.")


if __name__ == "__main__":
    main()
