"""What anomaly mode costs per training step, on a Flax transformer block stack.

Prints, measured side by side in one process (shuffled interleaved rounds; the median of the
per-round ratios, with their quartiles and the median's 95% interval), the time of one jitted
train step (gradient and an SGD update) of each candidate over the same step run plainly:
  * the step called inside `with jamp.autograd.detect_anomaly():`, the function unmarked:
    JAX's `jax_debug_nans` tests every output of the compiled step on the host, and the call
    takes JAX's Python dispatch path instead of its C++ one;
  * the loss marked `anomaly_checked`, the step called inside the block: jamp's own checks,
    one test per equation of the forward and the backward inside the compiled program.

No candidate meets a NaN here: a NaN makes JAX run the step again op by op (and jamp stop it),
which costs what it costs once. Anomaly mode is for debugging; there is no target.

Run: python benchmarks/anomaly_overhead.py [--quick]
"""

from __future__ import annotations

import argparse
import warnings

import jax

from jamp.autograd.anomaly_mode import anomaly_checked, detect_anomaly
from common import print_ratios, time_side_by_side, train_step_arguments, transformer_problem

BASELINE = "plain step"
UNMARKED = "step inside detect_anomaly()"
MARKED = "anomaly_checked loss in detect_anomaly()"


def sgd_step(loss):
    """A jitted `(params, tokens) -> params` taking one SGD step on `loss`."""

    def step(params, tokens):
        grads = jax.grad(loss)(params, tokens)
        return jax.tree_util.tree_map(lambda p, g: p - 1e-3 * g, params, grads)

    return jax.jit(step)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    train_step_arguments(parser, rounds=100)
    args = parser.parse_args()
    loss, params, tokens = transformer_problem(args)

    warnings.filterwarnings("ignore", "jamp anomaly detection is on")
    block = detect_anomaly()
    plain = sgd_step(loss)
    marked = sgd_step(anomaly_checked(loss))

    def inside_block(step):
        def run():
            with block:
                return step(params, tokens)
        return run

    # Each step starts from the same parameters: the values stay finite round after round.
    candidates = {
        BASELINE: lambda: plain(params, tokens),
        UNMARKED: inside_block(plain),
        MARKED: inside_block(marked),
    }
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}; transformer width "
          f"{args.width}, depth {args.depth}, batch {args.batch}x{args.seq}")
    times = time_side_by_side(candidates, rounds=args.rounds, steps=args.steps)
    print_ratios(f"Train step time over the plain step (median of {args.rounds} paired rounds, "
                 f"quartiles, 95% CI of the median):", times, baseline=BASELINE)


if __name__ == "__main__":
    main()
