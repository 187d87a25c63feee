"""What fp8 costs: the fp8 training step against the bfloat16 autocast step and the float32 one.

The model is a float32 Flax transformer block stack. The bfloat16 step is
`jamp.autocast(loss, dtype=jnp.bfloat16)`; the fp8 step is the same with the rule
`("Block_*", jamp.fp8.recipe(name))`: the blocks' linear layers multiply in float8, the
vocabulary projection (the LM head) and attention's batched matmuls stay in bfloat16.

Prints, measured side by side in one process (shuffled interleaved rounds; the median of the
per-round ratios, with their quartiles and the median's 95% interval):
  * the time of one jitted grad step over the bfloat16 autocast step's (target for tensorwise
    <= 2.0 on the CPU, where XLA has no float8 GEMM and jamp.fp8 emulates one: the casts to
    float8 and back, and the amaxes, are the extra work; on a GPU with float8 GEMMs the fp8
    step is the faster one);
  * the time to trace, lower and compile that grad step over the bfloat16 step's (target for
    tensorwise <= 1.5).

Run: python benchmarks/fp8_overhead.py [--quick] [--recipes tensorwise,rowwise,...]
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp

import jamp
from common import print_ratios, time_side_by_side, train_step_arguments, transformer_problem

BASELINE = "bfloat16 autocast step"
FLOAT32 = "float32 step"
STEP_TARGET, COMPILE_TARGET = 2.0, 1.5


def fp8_name(recipe: str) -> str:
    return f"fp8 {recipe} step (blocks in fp8)"


def losses(loss, recipes):
    """The candidates' losses by name: bfloat16 autocast, fp8 per recipe, float32."""
    out = {BASELINE: jamp.autocast(loss, dtype=jnp.bfloat16)}
    for recipe in recipes:
        out[fp8_name(recipe)] = jamp.autocast(
            loss, dtype=jnp.bfloat16, rules=[("Block_*", jamp.fp8.recipe(recipe))])
    out[FLOAT32] = loss
    return out


def compile_times(loss, recipes, params, tokens, rounds: int) -> dict[str, list[float]]:
    """Seconds to trace, lower and compile each candidate's grad step, one sample per round.

    Each round transforms a new function: jamp keeps the programs it built per function, a
    cache `jax.clear_caches` does not empty, so a transform built once would be timed once."""
    samples: dict[str, list[float]] = {}
    for _ in range(rounds):
        fresh = lambda params, tokens: loss(params, tokens)  # noqa: E731
        for name, candidate in losses(fresh, recipes).items():
            jax.clear_caches()  # every round traces and compiles from nothing
            start = time.perf_counter()
            jax.jit(jax.value_and_grad(candidate)).lower(params, tokens).compile()
            samples.setdefault(name, []).append(time.perf_counter() - start)
    return samples


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    train_step_arguments(parser, rounds=30)
    parser.add_argument("--recipes", default="tensorwise",
                        help="comma-separated fp8 recipes to measure (tensorwise, rowwise, "
                             "rowwise_with_gw_hp, mxfp8)")
    parser.add_argument("--compile-rounds", type=int, default=5,
                        help="rounds of the trace + compile timing (0 leaves it out)")
    args = parser.parse_args()
    loss, params, tokens = transformer_problem(args)
    if args.quick:
        args.compile_rounds = 1
    recipes = args.recipes.split(",")
    candidates = losses(loss, recipes)
    targets = {fp8_name("tensorwise"): STEP_TARGET} if "tensorwise" in recipes else {}

    print(f"jax {jax.__version__} on {jax.devices()[0].platform}; transformer width "
          f"{args.width}, depth {args.depth}, batch {args.batch}x{args.seq}")
    steps = {name: jax.jit(jax.value_and_grad(fn)) for name, fn in candidates.items()}
    times = time_side_by_side(
        {name: (lambda step=step: step(params, tokens)) for name, step in steps.items()},
        rounds=args.rounds, steps=args.steps)
    print_ratios(f"jitted grad step over the bfloat16 autocast step (median of {args.rounds} "
                 f"paired rounds, quartiles, 95% CI of the median):", times, BASELINE,
                 targets=targets)
    if not args.compile_rounds:
        return
    compiles = compile_times(loss, recipes, params, tokens, args.compile_rounds)
    print_ratios(f"\ntrace + compile of the grad step over the bfloat16 autocast step's "
                 f"(median of {args.compile_rounds} paired rounds):", compiles, BASELINE,
                 targets={k: COMPILE_TARGET for k in targets})


if __name__ == "__main__":
    main()
