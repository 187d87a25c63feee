"""The same models trained in torch and in jamp from the same weights on the same batches: an
MLP (64-256-256-10, GELU) and a pre-LN causal transformer (width 64, 2 heads, 2 blocks).

Prints, per model: each framework's skipped steps and loss scales under float16 autocast with
GradScaler, and the step-0 bfloat16 gap ratio: |jamp bf16 loss - torch bf16 loss| over
|torch bf16 loss - torch float32 loss|, the median over 20 batches (0: jamp's bfloat16 loss is
torch's; 1: it is as far from torch's as torch's own bfloat16 rounding moves the loss).

Run: python benchmarks/torch_training_parity.py [--steps 100] [--model mlp|transformer]
(torch is a test-only dependency; the test suite runs short versions of these comparisons.)
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jamp

Weights = dict[str, np.ndarray]

# -- the MLP -------------------------------------------------------------------------------

SIZES = (64, 256, 256, 10)


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        for i, width in enumerate(SIZES[1:]):
            x = nn.Dense(width, name=f"Dense_{i}")(x)
            if i < len(SIZES) - 2:
                x = nn.gelu(x, approximate=False)
        return x


def _uniform(rng, fan_in: int, shape) -> np.ndarray:
    """torch's `Linear` initialization: U(-1/sqrt(fan_in), 1/sqrt(fan_in))."""
    return rng.uniform(-1, 1, shape).astype(np.float32) / np.float32(np.sqrt(fan_in))


def mlp_weights(seed: int = 0) -> Weights:
    """Each layer's kernel (in, out) and bias, float32, by flax path."""
    rng = np.random.default_rng(seed)
    found = {}
    for i, (a, b) in enumerate(zip(SIZES[:-1], SIZES[1:])):
        found[f"Dense_{i}/kernel"] = _uniform(rng, a, (a, b))
        found[f"Dense_{i}/bias"] = _uniform(rng, a, (b,))
    return found


def mlp_batches(steps: int, batch: int, seed: int = 1):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((batch, SIZES[0])).astype(np.float32),
             rng.integers(0, SIZES[-1], batch)) for _ in range(steps)]


def torch_mlp(weights: Weights):
    import torch

    mods = []
    for i in range(len(SIZES) - 1):
        mods.append(_torch_linear(weights, f"Dense_{i}"))
        if i < len(SIZES) - 2:
            mods.append(torch.nn.GELU())
    return torch.nn.Sequential(*mods)


# -- the transformer -----------------------------------------------------------------------

VOCAB, LENGTH, WIDTH, HEADS, BLOCKS = 32, 16, 64, 2, 2
EPS = 1e-5  # torch's LayerNorm default


class Block(nn.Module):
    """Pre-LN: x + attention(LN(x)), then x + MLP(LN(x)); attention written out as torch's
    model below writes it (scores scaled by a Python float, masked, softmax)."""

    @nn.compact
    def __call__(self, x):
        batch, length, _ = x.shape
        head = WIDTH // HEADS
        h = nn.LayerNorm(epsilon=EPS, use_fast_variance=False, name="ln_1")(x)
        q, k, v = jnp.split(nn.Dense(3 * WIDTH, name="qkv")(h), 3, axis=-1)
        q, k, v = (t.reshape(batch, length, HEADS, head).transpose(0, 2, 1, 3)
                   for t in (q, k, v))
        scores = q @ k.transpose(0, 1, 3, 2) * (1 / math.sqrt(head))
        causal = jnp.tril(jnp.ones((length, length), bool))
        probs = jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), axis=-1)
        attended = (probs @ v).transpose(0, 2, 1, 3).reshape(batch, length, WIDTH)
        x = x + nn.Dense(WIDTH, name="out")(attended)
        h = nn.LayerNorm(epsilon=EPS, use_fast_variance=False, name="ln_2")(x)
        h = nn.gelu(nn.Dense(4 * WIDTH, name="fc")(h), approximate=False)
        return x + nn.Dense(WIDTH, name="proj")(h)


class Transformer(nn.Module):
    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(VOCAB, WIDTH, name="embed")(tokens)
        x = x + self.param("position", nn.initializers.normal(0.02), (LENGTH, WIDTH))
        for i in range(BLOCKS):
            x = Block(name=f"block_{i}")(x)
        x = nn.LayerNorm(epsilon=EPS, use_fast_variance=False, name="ln_f")(x)
        return nn.Dense(VOCAB, name="head")(x)


def _dense(rng, name: str, fan_in: int, fan_out: int) -> Weights:
    return {f"{name}/kernel": _uniform(rng, fan_in, (fan_in, fan_out)),
            f"{name}/bias": _uniform(rng, fan_in, (fan_out,))}


def _layer_norm(rng, name: str) -> Weights:
    return {f"{name}/scale": 1 + 0.1 * rng.standard_normal(WIDTH).astype(np.float32),
            f"{name}/bias": 0.1 * rng.standard_normal(WIDTH).astype(np.float32)}


def transformer_weights(seed: int = 0) -> Weights:
    """The transformer's weights, float32, by flax path."""
    rng = np.random.default_rng(seed)
    found = {"embed/embedding": rng.standard_normal((VOCAB, WIDTH)).astype(np.float32),
             "position": 0.1 * rng.standard_normal((LENGTH, WIDTH)).astype(np.float32)}
    for i in range(BLOCKS):
        block = f"block_{i}"
        found.update(_layer_norm(rng, f"{block}/ln_1"))
        found.update(_dense(rng, f"{block}/qkv", WIDTH, 3 * WIDTH))
        found.update(_dense(rng, f"{block}/out", WIDTH, WIDTH))
        found.update(_layer_norm(rng, f"{block}/ln_2"))
        found.update(_dense(rng, f"{block}/fc", WIDTH, 4 * WIDTH))
        found.update(_dense(rng, f"{block}/proj", 4 * WIDTH, WIDTH))
    found.update(_layer_norm(rng, "ln_f"))
    found.update(_dense(rng, "head", WIDTH, VOCAB))
    return found


def transformer_batches(steps: int, batch: int, seed: int = 1):
    rng = np.random.default_rng(seed)
    return [(rng.integers(0, VOCAB, (batch, LENGTH)), rng.integers(0, VOCAB, (batch, LENGTH)))
            for _ in range(steps)]


def torch_transformer(weights: Weights):
    import torch

    def layer_norm(name):
        norm = torch.nn.LayerNorm(WIDTH, eps=EPS)
        with torch.no_grad():
            norm.weight.copy_(torch.from_numpy(weights[f"{name}/scale"]))
            norm.bias.copy_(torch.from_numpy(weights[f"{name}/bias"]))
        return norm

    class TorchBlock(torch.nn.Module):
        def __init__(self, name):
            super().__init__()
            self.ln_1, self.ln_2 = layer_norm(f"{name}/ln_1"), layer_norm(f"{name}/ln_2")
            self.qkv = _torch_linear(weights, f"{name}/qkv")
            self.out = _torch_linear(weights, f"{name}/out")
            self.fc = _torch_linear(weights, f"{name}/fc")
            self.proj = _torch_linear(weights, f"{name}/proj")

        def forward(self, x):
            batch, length, _ = x.shape
            head = WIDTH // HEADS
            q, k, v = (t.reshape(batch, length, HEADS, head).transpose(1, 2)
                       for t in self.qkv(self.ln_1(x)).chunk(3, dim=-1))
            scores = q @ k.transpose(-2, -1) * (1 / math.sqrt(head))
            causal = torch.ones(length, length, dtype=torch.bool).tril()
            probs = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
            attended = (probs @ v).transpose(1, 2).reshape(batch, length, WIDTH)
            x = x + self.out(attended)
            return x + self.proj(torch.nn.functional.gelu(self.fc(self.ln_2(x))))

    class TorchTransformer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(VOCAB, WIDTH)
            with torch.no_grad():
                self.embed.weight.copy_(torch.from_numpy(weights["embed/embedding"]))
            self.position = torch.nn.Parameter(torch.from_numpy(weights["position"].copy()))
            self.blocks = torch.nn.ModuleList(TorchBlock(f"block_{i}") for i in range(BLOCKS))
            self.ln_f = layer_norm("ln_f")
            self.head = _torch_linear(weights, "head")

        def forward(self, tokens):
            x = self.embed(tokens) + self.position
            for block in self.blocks:
                x = block(x)
            return self.head(self.ln_f(x))

    return TorchTransformer()


# -- both ----------------------------------------------------------------------------------

def _torch_linear(weights: Weights, name: str):
    import torch

    kernel = weights[f"{name}/kernel"]
    linear = torch.nn.Linear(*kernel.shape)
    with torch.no_grad():
        linear.weight.copy_(torch.from_numpy(kernel.T.copy()))
        linear.bias.copy_(torch.from_numpy(weights[f"{name}/bias"]))
    return linear


@dataclasses.dataclass(frozen=True)
class Model:
    """One model in both frameworks: the flax module, its weights, the torch twin built from
    them, and its batches ((inputs, integer labels) per step)."""

    name: str
    module: nn.Module
    weights: Callable[[], Weights]
    torch_model: Callable[[Weights], Any]
    batches: Callable[..., list]


MODELS = {"mlp": Model("mlp", MLP(), mlp_weights, torch_mlp, mlp_batches),
          "transformer": Model("transformer", Transformer(), transformer_weights,
                               torch_transformer, transformer_batches)}


def flax_params(weights: Weights) -> dict:
    """The flax variables holding `weights` (keyed by '/'-joined paths)."""
    params: dict = {}
    for path, value in weights.items():
        *scopes, leaf = path.split("/")
        node = params
        for scope in scopes:
            node = node.setdefault(scope, {})
        node[leaf] = jnp.asarray(value)
    return {"params": params}


def _torch_loss(model, x, y):
    import torch

    logits = model(torch.from_numpy(x))
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                                             torch.from_numpy(y).reshape(-1))


def jamp_loss(model: Model) -> Callable:
    """The flax model's mean cross-entropy, as `_torch_loss` computes torch's."""
    def loss_fn(params, x, y):
        logits = model.module.apply(params, x)
        return optax.softmax_cross_entropy_with_integer_labels(
            logits.reshape(-1, logits.shape[-1]), y.reshape(-1)).mean()
    return loss_fn


SCALER = dict(init_scale=2.0 ** 16, growth_factor=2.0, backoff_factor=0.5, growth_interval=1)


def torch_run(model: Model, data, lr: float = 1e-3) -> tuple[list[bool], list[float]]:
    """torch's skipped steps and loss scales (float16 autocast on the CPU, GradScaler)."""
    import torch

    net = model.torch_model(model.weights())
    opt = torch.optim.AdamW(net.parameters(), lr=lr)
    scaler = torch.amp.GradScaler("cpu", **SCALER)
    skipped, scales = [], []
    for x, y in data:
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = _torch_loss(net, x, y)
        scales.append(scaler.get_scale())
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        found = sum(v.item() for v in scaler._found_inf_per_device(opt).values()) > 0
        scaler.step(opt)
        scaler.update()
        skipped.append(bool(found))
    return skipped, scales


def jamp_run(model: Model, data, lr: float = 1e-3) -> tuple[list[bool], list[float]]:
    """jamp's skipped steps and loss scales for the same run."""
    params = flax_params(model.weights())
    tx = optax.adamw(lr)
    scaler = jamp.GradScaler(**SCALER)
    amp_loss = jamp.autocast(jamp_loss(model), device_type="cpu", dtype=jnp.float16)

    @jax.jit
    def step(params, opt_state, state, x, y):
        grads = jax.grad(lambda p: scaler.scale(state, amp_loss(p, x, y)))(params)
        grads, found_inf = scaler.unscale(state, grads)
        updates, new_opt = tx.update(grads, opt_state, params)
        finite = jnp.logical_not(found_inf)
        params = jax.tree.map(lambda p, u: jnp.where(finite, p + u, p), params, updates)
        opt_state = jax.tree.map(lambda n, o: jnp.where(finite, n, o), new_opt, opt_state)
        return params, opt_state, scaler.update(state, found_inf), found_inf

    opt_state, state = tx.init(params), scaler.init()
    skipped, scales = [], []
    for x, y in data:
        scales.append(float(scaler.get_scale(state)))
        params, opt_state, state, found = step(params, opt_state, state, x, y)
        skipped.append(bool(found))
    return skipped, scales


def gap_ratios(model: Model, data) -> list[float]:
    """Per batch of `data`, at the initial weights: |jamp bf16 loss - torch bf16 loss| /
    |torch bf16 loss - torch float32 loss| (see the module's docstring)."""
    import torch

    weights = model.weights()
    net = model.torch_model(weights)
    params = flax_params(weights)
    ours = jax.jit(jamp.autocast(jamp_loss(model), device_type="cpu"))
    ratios = []
    for x, y in data:
        with torch.no_grad():
            f32 = _torch_loss(net, x, y).item()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                bf16 = _torch_loss(net, x, y).item()
        gap = abs(bf16 - f32)
        ratios.append(abs(float(ours(params, x, y)) - bf16) / gap if gap else 0.0)
    return ratios


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--model", choices=sorted(MODELS), action="append")
    args = parser.parse_args()
    for name in args.model or list(MODELS):
        model = MODELS[name]
        data = model.batches(args.steps, args.batch)
        torch_skipped, torch_scales = torch_run(model, data)
        skipped, scales = jamp_run(model, data)
        print(f"{name}, float16, {args.steps} steps:")
        print("  skipped steps, torch:", [i for i, s in enumerate(torch_skipped) if s])
        print("  skipped steps, jamp: ", [i for i, s in enumerate(skipped) if s])
        print("  skipped steps equal:", skipped == torch_skipped,
              " loss scales equal:", scales == torch_scales)
        ratios = gap_ratios(model, model.batches(20, args.batch, seed=2))
        print(f"{name}, bfloat16, step 0: gap ratio |jamp - torch| / |torch bf16 - torch f32| "
              f"over 20 batches: median {np.median(ratios):.2f}, max {max(ratios):.2f}")


if __name__ == "__main__":
    main()
