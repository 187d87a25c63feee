"""What autocast costs: jamp.autocast of a float32 Flax transformer vs the same model hand-written
in bfloat16 (Flax's `dtype=jnp.bfloat16`, float32 params).

Prints four ratios, measured side by side in one process:
  * the jitted grad step of autocast(f32 model, bfloat16) over the hand-written one (target <= 1.05);
  * trace + compile time of a 12-block transformer under autocast over the hand-written one
    (target <= 1.3);
  * an eager call (no jax.jit) of the autocast loss over the same loss called eagerly without
    autocast, on a small transformer: eager autocast / plain eager (target <= 1.5; autocast runs
    the loss's Python on every call, as an eager call does, and reuses its compiled program);
    the eager grad is printed beside (`--eager-only` prints these alone);
  * the bytes of the activations saved for the backward pass (jax.vjp's residuals) under autocast
    over the hand-written bfloat16 model's (target <= 1.15), on both op tables. This one is a count
    of bytes, not a timing: it is the same on every run.
Where jaxamp or grampax are installed (`pip install '.[bench]'`), their figures are printed beside;
what they print themselves is dropped (grampax 0.1.0 prints an array for every operation it
traces, some 13,000 lines a run).

Run: python benchmarks/autocast_overhead.py [--quick] [--eager-only]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import time

import jax
import jax.numpy as jnp

import jamp
from common import (TransformerStack, next_token_loss, print_ratios, residual_bytes,
                    time_side_by_side)


def make_loss(model):
    def loss(params, tokens):
        return next_token_loss(model.apply(params, tokens), tokens)
    return loss


def silenced(fn):
    """`fn` with whatever it prints to stdout dropped, so that only this report is printed.

    A peer prints while it traces (grampax 0.1.0 prints every operation's first operand), which
    jax.jit and jax.value_and_grad do when they call `fn`; calls served from jit's cache run no
    Python and print nothing anyway.
    """
    @functools.wraps(fn)
    def quiet(*args, **kwargs):
        with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink):
            return fn(*args, **kwargs)
    return quiet


def peer_autocasts():
    """The autocast transforms of other libraries that are installed and run here, each with
    its own printing silenced."""
    peers = {}
    try:
        import jaxamp
        peers["jaxamp.amp"] = lambda f: silenced(jaxamp.amp(f, compute_dtype=jnp.bfloat16))
    except Exception as e:  # not installed, or broken against this jax
        print(f"  (jaxamp not measured: {type(e).__name__}: {e})")
    try:
        import grampax
        peers["grampax.autocast"] = lambda f: silenced(grampax.autocast(f, dtype=jnp.bfloat16))
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


def eager_call_times(args):
    """Seconds per eager call (no jax.jit anywhere) of the loss and of its grad."""
    model = TransformerStack(width=args.eager_width, depth=2, num_heads=4)
    tokens = jax.random.randint(jax.random.key(1), (4, 32), 0, 256)
    params = model.init(jax.random.key(0), tokens)
    plain = make_loss(model)
    auto = jamp.autocast(plain, dtype=jnp.bfloat16)
    candidates = {
        "plain loss, eager": lambda: plain(params, tokens),
        "jamp.autocast(loss), eager": lambda: auto(params, tokens),
        "jax.grad(loss), eager": lambda: jax.grad(plain)(params, tokens),
        "jax.grad(jamp.autocast(loss)), eager": lambda: jax.grad(auto)(params, tokens),
    }
    # A smoke run (--quick) times one call per round: op-by-op eager calls are slow.
    return time_side_by_side(candidates, rounds=args.rounds, steps=1 if args.quick else 3)


def print_eager(args):
    eager = eager_call_times(args)
    print_ratios(f"\neager calls, eager autocast / plain eager, 2 blocks of width "
                 f"{args.eager_width} (median of {args.rounds} paired rounds):",
                 {k: eager[k] for k in ("plain loss, eager", "jamp.autocast(loss), eager")},
                 "plain loss, eager", targets={"jamp.autocast(loss), eager": 1.5})
    print_ratios("", {k: eager[k] for k in ("jax.grad(loss), eager",
                                             "jax.grad(jamp.autocast(loss)), eager")},
                 "jax.grad(loss), eager")


def residual_ratios(args):
    """Bytes of jax.vjp's residuals of the grad step: autocast and float32 over hand-written."""
    f32_model = TransformerStack(width=args.width, depth=args.depth, num_heads=4)
    bf16_model = TransformerStack(width=args.width, depth=args.depth, num_heads=4,
                                  dtype=jnp.bfloat16)
    tokens = jax.random.randint(jax.random.key(1), (args.batch, args.seq), 0, 256)
    params = f32_model.init(jax.random.key(0), tokens)
    hand = residual_bytes(lambda p: make_loss(bf16_model)(p, tokens), params)
    rows = {"hand-written bfloat16 (flax dtype=)": hand}
    for device_type in ("cpu", "cuda"):
        auto = jamp.autocast(make_loss(f32_model), dtype=jnp.bfloat16, device_type=device_type)
        rows[f"jamp.autocast(f32 model), {device_type} table"] = residual_bytes(
            lambda p: auto(p, tokens), params)
    rows["float32 (no mixed precision)"] = residual_bytes(
        lambda p: make_loss(f32_model)(p, tokens), params)
    return rows


def print_residuals(title, rows, baseline, target_names, target):
    print(title)
    for name, size in rows.items():
        ratio = size / rows[baseline]
        mark = ""
        if name in target_names:
            mark = f"  (target <= {target:.2f}: {'met' if ratio <= target else 'MISSED'})"
        print(f"  {name:40s} {size / 2**20:9.2f} MiB   x{ratio:.3f}{mark}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds, for a smoke run")
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--eager-width", type=int, default=64)
    parser.add_argument("--eager-only", action="store_true", help="only the eager calls")
    args = parser.parse_args()
    args.rounds, args.steps, args.compile_rounds = (3, 3, 1) if args.quick else (9, 10, 3)

    print(f"jax {jax.__version__} on {jax.default_backend()}; transformer width {args.width}, "
          f"batch {args.batch}x{args.seq}")
    if args.eager_only:
        print_eager(args)
        return
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
    print_eager(args)
    rows = residual_ratios(args)
    print_residuals(f"\nactivations saved for the backward pass, {args.depth} blocks "
                    f"(jax.vjp's residuals):", rows, base,
                    [name for name in rows if name.startswith("jamp")], 1.15)


if __name__ == "__main__":
    main()
