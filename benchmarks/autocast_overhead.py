"""What autocast costs: jamp.autocast of a float32 Flax transformer vs the same model hand-written
in bfloat16 (Flax's `dtype=jnp.bfloat16`, float32 params).

Prints two ratios, measured side by side in one process:
  * the jitted grad step of autocast(f32 model, bfloat16) over the hand-written one (target <= 1.05);
  * trace + compile time of a 12-block transformer under autocast over the hand-written one
    (target <= 1.3).
Where jaxamp or grampax are installed (`pip install '.[bench]'`), their figures are printed beside.

Run: python benchmarks/autocast_overhead.py [--quick]
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp

import jamp
from common import TransformerStack, next_token_loss, print_ratios, time_side_by_side


def make_loss(model):
    def loss(params, tokens):
        return next_token_loss(model.apply(params, tokens), tokens)
    return loss


def peer_autocasts():
    """The autocast transforms of other libraries that are installed and run here."""
    peers = {}
    try:
        import jaxamp
        peers["jaxamp.amp"] = lambda f: jaxamp.amp(f, compute_dtype=jnp.bfloat16)
    except Exception as e:  # not installed, or broken against this jax
        print(f"  (jaxamp not measured: {type(e).__name__}: {e})")
    try:
        import grampax
        peers["grampax.autocast"] = lambda f: grampax.autocast(f, dtype=jnp.bfloat16)
    except Exception as e:
        print(f"  (grampax not measured: {type(e).__name__}: {e})")
    return peers


def grad_step_times(args, peers):
    f32_model = TransformerStack(width=args.width, depth=args.depth, num_heads=4)
    bf16_model = TransformerStack(width=args.width, depth=args.depth, num_heads=4,
                                  dtype=jnp.bfloat16)
    tokens = jax.random.randint(jax.random.key(1), (args.batch, args.seq), 0, 256)
    params = f32_model.init(jax.random.key(0), tokens)

    losses = {
        "hand-written bfloat16 (flax dtype=)": make_loss(bf16_model),
        "jamp.autocast(f32 model, bfloat16)": jamp.autocast(make_loss(f32_model),
                                                            dtype=jnp.bfloat16),
        "float32 (no mixed precision)": make_loss(f32_model),
    }
    for name, wrap in peers.items():
        losses[f"{name}(f32 model, bfloat16)"] = wrap(make_loss(f32_model))

    candidates = {}
    for name, loss in losses.items():
        step = jax.jit(jax.value_and_grad(loss))
        try:
            jax.block_until_ready(step(params, tokens))
        except Exception as e:
            print(f"  ({name} does not run here: {type(e).__name__}: {str(e)[:200]})")
            continue
        candidates[name] = (lambda step=step: step(params, tokens))
    return time_side_by_side(candidates, rounds=args.rounds, steps=args.steps)


def compile_times(args, peers):
    """Seconds to trace, lower and compile the grad of a 12-block transformer, per round."""
    depth = 12
    f32_model = TransformerStack(width=args.width, depth=depth, num_heads=4)
    bf16_model = TransformerStack(width=args.width, depth=depth, num_heads=4, dtype=jnp.bfloat16)
    tokens = jax.random.randint(jax.random.key(1), (args.batch, args.seq), 0, 256)
    params = f32_model.init(jax.random.key(0), tokens)

    builders = {
        "hand-written bfloat16 (flax dtype=)": lambda: make_loss(bf16_model),
        "jamp.autocast(f32 model, bfloat16)":
            lambda: jamp.autocast(make_loss(f32_model), dtype=jnp.bfloat16),
        "float32 (no mixed precision)": lambda: make_loss(f32_model),
    }
    for name, wrap in peers.items():
        builders[f"{name}(f32 model, bfloat16)"] = (lambda wrap=wrap: wrap(make_loss(f32_model)))

    samples = {name: [] for name in builders}
    for _ in range(args.compile_rounds):
        for name, build in builders.items():
            if samples[name] is None:
                continue
            jax.clear_caches()  # every round traces and compiles from nothing
            start = time.perf_counter()
            try:
                jax.jit(jax.value_and_grad(build())).lower(params, tokens).compile()
            except Exception:
                samples[name] = None
                continue
            samples[name].append(time.perf_counter() - start)
    return {name: s for name, s in samples.items() if s}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds, for a smoke run")
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    args = parser.parse_args()
    args.rounds, args.steps, args.compile_rounds = (3, 3, 1) if args.quick else (9, 10, 3)

    print(f"jax {jax.__version__} on {jax.default_backend()}; transformer width {args.width}, "
          f"batch {args.batch}x{args.seq}")
    peers = peer_autocasts()
    base = "hand-written bfloat16 (flax dtype=)"
    mine = "jamp.autocast(f32 model, bfloat16)"
    steps = grad_step_times(args, peers)
    print_ratios(f"\njitted grad step, {args.depth} blocks "
                 f"(median of {args.rounds} paired rounds):",
                 steps, base, targets={mine: 1.05})
    compiles = compile_times(args, peers)
    print_ratios(f"\ntrace + compile of the grad, 12 blocks "
                 f"(median of {args.compile_rounds} paired rounds):",
                 compiles, base, targets={mine: 1.3})


if __name__ == "__main__":
    main()
