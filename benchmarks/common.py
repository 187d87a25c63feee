"""Shared pieces of the benchmarks: a Flax transformer block stack and a side-by-side timer.

Every benchmark measures its candidates in one process, interleaved round by round in a shuffled
order, and reports each candidate's ratio over the baseline as the median of its per-round ratios:
a slow moment of a shared machine then hits both sides of a ratio alike.
"""

from __future__ import annotations

import math
import random
import statistics
import time
from typing import Any, Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp


class Block(nn.Module):
    """A pre-norm transformer block: causal self-attention and a GELU MLP."""

    num_heads: int
    mlp_ratio: int = 4
    dtype: Any = None  # compute dtype of the hand-written mixed-precision variant
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):
        kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        width = x.shape[-1]
        mask = nn.make_causal_mask(jnp.ones(x.shape[:2], jnp.int32))
        h = nn.LayerNorm(**kw)(x)
        x = x + nn.MultiHeadDotProductAttention(num_heads=self.num_heads, **kw)(h, mask=mask)
        h = nn.LayerNorm(**kw)(x)
        h = nn.Dense(self.mlp_ratio * width, **kw)(h)
        h = nn.Dense(width, **kw)(nn.gelu(h))
        return x + h


class TransformerStack(nn.Module):
    """Token embedding, `depth` blocks, final norm and a vocabulary projection."""

    vocab: int = 256
    width: int = 128
    depth: int = 4
    num_heads: int = 4
    dtype: Any = None
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, tokens):
        kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        x = nn.Embed(self.vocab, self.width, **kw)(tokens)
        for _ in range(self.depth):
            x = Block(self.num_heads, **kw)(x)
        x = nn.LayerNorm(**kw)(x)
        return nn.Dense(self.vocab, **kw)(x).astype(jnp.float32)


def train_step_arguments(parser, rounds: int):
    """Adds the options of the benchmarks that time a train step of `TransformerStack`:
    --quick, --width, --depth, --batch, --seq, --rounds (default `rounds`), --steps."""
    parser.add_argument("--quick", action="store_true", help="fewer rounds, smaller model")
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--depth", type=int, default=None, help="layers (4; 2 with --quick)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=rounds)
    parser.add_argument("--steps", type=int, default=1)


def transformer_problem(args):
    """(loss, params, tokens) of the `TransformerStack` the options describe (`--quick`
    settles the rounds, steps and depth it leaves open)."""
    if args.quick:
        args.rounds, args.steps = 3, 3
    if args.depth is None:
        args.depth = 2 if args.quick else 4
    model = TransformerStack(width=args.width, depth=args.depth, num_heads=4)
    tokens = jax.random.randint(jax.random.key(1), (args.batch, args.seq), 0, 256)
    params = model.init(jax.random.key(0), tokens)

    def loss(params, tokens):
        return next_token_loss(model.apply(params, tokens), tokens)

    return loss, params, tokens


def next_token_loss(logits, tokens):
    """Mean cross-entropy of predicting token t+1 from the logits at t."""
    logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32))
    target = jax.nn.one_hot(tokens[:, 1:], logits.shape[-1])
    return -jnp.mean(jnp.sum(logp * target, axis=-1))


def residual_bytes(loss: Callable, *args) -> int:
    """Bytes of the values `jax.vjp` keeps for the backward pass of `loss(*args)`: the leaves
    of the pullback (its saved residuals), whose shapes and dtypes tracing alone decides."""
    pullback = jax.eval_shape(lambda *a: jax.vjp(loss, *a)[1], *args)
    return sum(math.prod(x.shape) * x.dtype.itemsize
               for x in jax.tree_util.tree_leaves(pullback))


def block_until_ready(tree):
    return jax.tree_util.tree_map(
        lambda x: x.block_until_ready() if hasattr(x, "block_until_ready") else x, tree)


def time_side_by_side(
    candidates: dict[str, Callable[[], Any]], rounds: int = 7, steps: int = 10,
    warmup: int = 2, seed: int = 0,
) -> dict[str, list[float]]:
    """Seconds per call of each zero-argument callable, one sample per round, measured interleaved.

    Each callable runs `warmup` times first (compilation). Then in each of `rounds` rounds every
    candidate runs `steps` times back to back, the candidates in a fresh random order each round
    so that none always follows the same neighbour. Returns the per-round samples, in round
    order, so that candidates can be compared round by round (`paired_ratios`).
    """
    for fn in candidates.values():
        for _ in range(warmup):
            block_until_ready(fn())
    order = random.Random(seed)
    names = list(candidates)
    samples: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(rounds):
        order.shuffle(names)
        for name in names:
            fn = candidates[name]
            start = time.perf_counter()
            for _ in range(steps):
                out = fn()
            block_until_ready(out)
            samples[name].append((time.perf_counter() - start) / steps)
    return samples


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs)


def median_interval(xs: Sequence[float], z: float = 1.96) -> tuple[float, float] | None:
    """A distribution-free 95% confidence interval of the median of `xs` (None for few samples).

    The bounds are order statistics: with n samples the median lies between the ones of rank
    n/2 -/+ z*sqrt(n)/2 with about 95% probability, whatever the noise's distribution (a
    binomial count of samples below the median, in its normal approximation).
    """
    n = len(xs)
    half_width = z * math.sqrt(n) / 2
    lo, hi = math.floor(n / 2 - half_width), math.ceil(n / 2 + half_width)
    if n < 8 or lo < 1 or hi > n:
        return None
    ordered = sorted(xs)
    return ordered[lo - 1], ordered[hi - 1]


def paired_ratios(samples: dict[str, list[float]], baseline: str) -> dict[str, list[float]]:
    """Each candidate's time over the baseline's, round by round.

    A slow moment of a shared machine lasts longer than one round, so it hits both sides of a
    round's ratio alike: the median of these ratios is steadier than the ratio of medians.
    """
    base = samples[baseline]
    return {name: [t / b for t, b in zip(s, base)] for name, s in samples.items()}


def verdict(ratios: Sequence[float], target: float) -> str:
    """'met' when the whole 95% interval of the median ratio is at or under `target`.

    A median under the target whose interval still reaches over it says so, since another run
    on the same machine could land on either side.
    """
    interval = median_interval(ratios)
    if interval is not None and interval[1] <= target:
        return "met"
    if median(ratios) <= target:
        if interval is None:
            return "met by the median of too few rounds for an interval"
        return "met by the median only; its 95% interval reaches over the target"
    return "MISSED"


def print_ratios(title: str, samples: dict[str, list[float]], baseline: str,
                 targets: dict[str, float] | None = None, names: Sequence[str] | None = None):
    """Prints each candidate's median time and its median paired ratio over `baseline`.

    Then, in brackets, the ratio's quartiles over the rounds (how noisy one round is) and the
    95% confidence interval of the median ratio (how sure the printed median is); a target is
    judged by `verdict`.
    """
    targets = targets or {}
    ratios = paired_ratios(samples, baseline)
    print(title)
    for name in names or samples:
        r = ratios[name]
        mid = median(r)
        spread = ""
        if len(r) >= 4 and name != baseline:
            q1, _, q3 = statistics.quantiles(r, n=4)
            spread = f"  quartiles [{q1:.3f}, {q3:.3f}]"
            interval = median_interval(r)
            if interval is not None:
                spread += f"  95% CI [{interval[0]:.3f}, {interval[1]:.3f}]"
        target = ""
        if name in targets:
            target = f"  (target <= {targets[name]:.2f}: {verdict(r, targets[name])})"
        print(f"  {name:40s} {median(samples[name]) * 1e3:9.3f} ms   x{mid:.3f}{spread}{target}")
