"""Shared pieces of the benchmarks: a Flax transformer block stack and a side-by-side timer.

Every benchmark measures its candidates in one process, interleaved round by round, so that
a slow moment of the machine hits all of them alike; the reported figure is the median.
"""

from __future__ import annotations

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


def next_token_loss(logits, tokens):
    """Mean cross-entropy of predicting token t+1 from the logits at t."""
    logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32))
    target = jax.nn.one_hot(tokens[:, 1:], logits.shape[-1])
    return -jnp.mean(jnp.sum(logp * target, axis=-1))


def block_until_ready(tree):
    return jax.tree_util.tree_map(
        lambda x: x.block_until_ready() if hasattr(x, "block_until_ready") else x, tree)


def time_side_by_side(
    candidates: dict[str, Callable[[], Any]], rounds: int = 7, steps: int = 10,
    warmup: int = 2,
) -> dict[str, float]:
    """Median seconds per call of each zero-argument callable, measured interleaved.

    Each callable runs `warmup` times first (compilation), then in each of `rounds`
    rounds every candidate runs `steps` times back to back.
    """
    for fn in candidates.values():
        for _ in range(warmup):
            block_until_ready(fn())
    samples: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(rounds):
        for name, fn in candidates.items():
            start = time.perf_counter()
            for _ in range(steps):
                out = fn()
            block_until_ready(out)
            samples[name].append((time.perf_counter() - start) / steps)
    return {name: sorted(s)[len(s) // 2] for name, s in samples.items()}


def print_ratios(title: str, times: dict[str, float], baseline: str,
                 targets: dict[str, float] | None = None, names: Sequence[str] | None = None):
    """Prints each candidate's time and its ratio over `baseline`, with its target if any."""
    targets = targets or {}
    print(title)
    base = times[baseline]
    for name in names or times:
        ratio = times[name] / base
        target = f"  (target <= {targets[name]:.2f}: {'met' if ratio <= targets[name] else 'MISSED'})" \
            if name in targets else ""
        print(f"  {name:40s} {times[name] * 1e3:9.3f} ms   x{ratio:.3f}{target}")
