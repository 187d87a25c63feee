"""The same MLP (64-256-256-10, GELU) trained in torch and in jamp from the same weights on the
same batches, under float16 autocast with GradScaler: prints each framework's skipped steps and
loss scales, and the step-0 bfloat16 loss of each against its float32 loss.

Run: python benchmarks/torch_training_parity.py [--steps 100]
(torch is a test-only dependency; the test suite runs a short version of this comparison.)
"""

from __future__ import annotations

import argparse

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jamp

SIZES = (64, 256, 256, 10)


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        for i, width in enumerate(SIZES[1:]):
            x = nn.Dense(width, name=f"Dense_{i}")(x)
            if i < len(SIZES) - 2:
                x = nn.gelu(x, approximate=False)
        return x


def weights(seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    """Each layer's (kernel (in, out), bias), float32, drawn as torch's `Linear` draws them."""
    rng = np.random.default_rng(seed)
    return [tuple(rng.uniform(-1, 1, shape).astype(np.float32) / np.float32(np.sqrt(a))
                  for shape in ((a, b), (b,)))
            for a, b in zip(SIZES[:-1], SIZES[1:])]


def batches(steps: int, batch: int, seed: int = 1):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((batch, SIZES[0])).astype(np.float32),
             rng.integers(0, SIZES[-1], batch)) for _ in range(steps)]


def flax_params(layers) -> dict:
    return {"params": {f"Dense_{i}": {"kernel": jnp.asarray(w), "bias": jnp.asarray(b)}
                       for i, (w, b) in enumerate(layers)}}


def torch_model(layers):
    import torch

    mods = []
    for i, (w, b) in enumerate(layers):
        linear = torch.nn.Linear(*w.shape)
        with torch.no_grad():
            linear.weight.copy_(torch.from_numpy(w.T.copy()))
            linear.bias.copy_(torch.from_numpy(b))
        mods.append(linear)
        if i < len(layers) - 1:
            mods.append(torch.nn.GELU())
    return torch.nn.Sequential(*mods)


SCALER = dict(init_scale=2.0 ** 16, growth_factor=2.0, backoff_factor=0.5, growth_interval=1)


def torch_run(layers, data, lr: float = 1e-3) -> tuple[list[bool], list[float]]:
    """torch's skipped steps and loss scales (float16 autocast on the CPU, GradScaler)."""
    import torch

    model = torch_model(layers)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    scaler = torch.amp.GradScaler("cpu", **SCALER)
    skipped, scales = [], []
    for x, y in data:
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = torch.nn.functional.cross_entropy(model(torch.from_numpy(x)),
                                                     torch.from_numpy(y))
        scales.append(scaler.get_scale())
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        found = sum(v.item() for v in scaler._found_inf_per_device(opt).values()) > 0
        scaler.step(opt)
        scaler.update()
        skipped.append(bool(found))
    return skipped, scales


def jamp_run(layers, data, lr: float = 1e-3) -> tuple[list[bool], list[float]]:
    """jamp's skipped steps and loss scales for the same run."""
    model = MLP()
    params = flax_params(layers)
    tx = optax.adamw(lr)
    scaler = jamp.GradScaler(**SCALER)

    def loss_fn(params, x, y):
        logits = model.apply(params, x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    amp_loss = jamp.autocast(loss_fn, device_type="cpu", dtype=jnp.float16)

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


def step0_losses(layers, x, y) -> dict[str, float]:
    """The step-0 loss of torch (float32 and bfloat16 autocast) and jamp (bfloat16)."""
    import torch

    model = torch_model(layers)
    with torch.no_grad():
        xt, yt = torch.from_numpy(x), torch.from_numpy(y)
        f32 = torch.nn.functional.cross_entropy(model(xt), yt).item()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            bf16 = torch.nn.functional.cross_entropy(model(xt), yt).item()

    def loss_fn(params, x, y):
        return optax.softmax_cross_entropy_with_integer_labels(MLP().apply(params, x), y).mean()

    ours = float(jamp.autocast(loss_fn, device_type="cpu")(flax_params(layers), x, y))
    return {"torch_f32": f32, "torch_bf16": bf16, "jamp_bf16": ours}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args()
    layers = weights()
    data = batches(args.steps, args.batch)
    ts, tscales = torch_run(layers, data)
    js, jscales = jamp_run(layers, data)
    print("skipped steps, torch:", [i for i, s in enumerate(ts) if s])
    print("skipped steps, jamp: ", [i for i, s in enumerate(js) if s])
    print("loss scales equal:", tscales == jscales)
    gaps = []
    for x, y in batches(20, args.batch, seed=2):
        losses = step0_losses(layers, x, y)
        gap = abs(losses["torch_bf16"] - losses["torch_f32"])
        gaps.append(abs(losses["jamp_bf16"] - losses["torch_bf16"]) / gap if gap else 0.0)
    print(f"step-0 bf16 loss, |jamp - torch| / |torch bf16 - torch f32| over 20 batches: "
          f"median {np.median(gaps):.2f}, max {max(gaps):.2f}")


if __name__ == "__main__":
    main()
