"""A small GPT-style byte-level language model in Flax linen."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp


class Block(nn.Module):
    num_heads: int
    dtype: Any = None

    @nn.compact
    def __call__(self, x):
        width = x.shape[-1]
        mask = nn.make_causal_mask(jnp.ones(x.shape[:2], jnp.int32))
        h = nn.LayerNorm(dtype=self.dtype)(x)
        x = x + nn.MultiHeadDotProductAttention(self.num_heads, dtype=self.dtype)(h, mask=mask)
        h = nn.LayerNorm(dtype=self.dtype)(x)
        h = nn.Dense(4 * width, dtype=self.dtype)(h)
        return x + nn.Dense(width, dtype=self.dtype)(nn.gelu(h))


class ByteGPT(nn.Module):
    """Embeddings, `depth` pre-norm blocks and a projection to 256 byte logits."""

    width: int = 128
    depth: int = 2
    num_heads: int = 4
    max_len: int = 256
    dtype: Any = None

    @nn.compact
    def __call__(self, tokens):
        positions = jnp.arange(tokens.shape[1])
        x = nn.Embed(256, self.width, dtype=self.dtype)(tokens)
        x = x + nn.Embed(self.max_len, self.width, dtype=self.dtype)(positions)
        for _ in range(self.depth):
            x = Block(self.num_heads, dtype=self.dtype)(x)
        return nn.Dense(256, dtype=self.dtype)(nn.LayerNorm(dtype=self.dtype)(x))


def next_byte_loss(logits, windows, weights=None):
    """Mean cross-entropy in nats of each next byte; `windows` holds inputs and targets.

    `weights`, one per window, weigh each window's mean (a padding mask, say)."""
    targets = windows[:, 1:]
    logp = jax.nn.log_softmax(logits)
    nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    if weights is None:
        return jnp.mean(nll)
    return jnp.mean(jnp.mean(nll, axis=-1) * weights)
