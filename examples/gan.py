"""Apex's GAN recipe at O2: two models, two optimizers, three losses, three loss scalers.

A generator (a linen MLP from 8-D noise to the plane) learns a ring of eight Gaussians against a
discriminator (a linen MLP from the plane to one logit). As Apex's "Advanced Amp Usage" page
describes, both are set up by one call,

    [apply_g, apply_d], [vars_g, vars_d], [tx_g, tx_d] = jamp.initialize(
        [g.apply, d.apply], [vars_g, vars_d], [optax.adam(...), optax.adam(...)],
        opt_level="O2", num_losses=3)

and each of the three losses has its own dynamic loss scale (`loss_id`):

- loss 0, the discriminator on real samples, reaches the discriminator's params only;
- loss 1, the discriminator on generated samples (the generator held fixed), likewise;
- loss 2, the generator's loss (the discriminator's verdict on its samples), reaches the
  generator's params only.

Each loss is scaled with `jamp.scale_loss(loss_k, opt_state, loss_id=k)` of the optimizer whose
params it reaches, and each optimizer takes one grad tree per loss, None for a loss that reaches
none of its params: `tx_d.update([g0, g1, None], ...)`, `tx_g.update([None, None, g2], ...)`.
Each optimizer's state holds all three scales; a scale moves only in the optimizer its loss
reaches, so the three that matter are the discriminator's 0 and 1 and the generator's 2.

The script prints the three losses and the three loss scales (`jamp.state_dict`) over training,
every change of a scale (an overflow of its loss's float16 grads, or Apex's 2000 clean steps),
and how close the generated samples are to the real distribution: the energy distance between
generated and real samples and the mean distance to the nearest of the eight modes, which fall
as the generator learns, and how many modes its samples cover.
"""

from __future__ import annotations

import argparse
import time
from typing import Any, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jamp

NOISE = 8
MODES = 8
RADIUS = 2.0
SPREAD = 0.05


class MLP(nn.Module):
    """Dense layers with leaky ReLUs between them."""

    features: Sequence[int]

    @nn.compact
    def __call__(self, x):
        for width in self.features[:-1]:
            x = nn.leaky_relu(nn.Dense(width)(x), 0.2)
        return nn.Dense(self.features[-1])(x)


def ring_centers() -> np.ndarray:
    angles = 2 * np.pi * np.arange(MODES) / MODES
    return RADIUS * np.stack([np.cos(angles), np.sin(angles)], -1).astype(np.float32)


def real_samples(rng: np.random.Generator, n: int) -> np.ndarray:
    """`n` points of the ring of Gaussians: a mode at random, plus noise of std `SPREAD`."""
    centers = ring_centers()[rng.integers(MODES, size=n)]
    return (centers + SPREAD * rng.standard_normal((n, 2))).astype(np.float32)


def energy_distance(a: np.ndarray, b: np.ndarray) -> float:
    """Székely's energy distance between two samples: 0 when their distributions are equal."""
    def mean_dist(x, y):
        return float(np.mean(np.linalg.norm(x[:, None, :] - y[None, :, :], axis=-1)))
    return 2 * mean_dist(a, b) - mean_dist(a, a) - mean_dist(b, b)


def sample_quality(fake: np.ndarray, real: np.ndarray) -> dict[str, float]:
    """How close generated samples are to the ring: the energy distance to real samples, the
    mean distance to the nearest mode, and the modes that hold at least 2% of the samples
    within 4 standard deviations."""
    fake = np.asarray(fake, np.float32)
    dist = np.linalg.norm(fake[:, None, :] - ring_centers()[None], axis=-1)
    nearest, which = dist.min(1), dist.argmin(1)
    close = nearest < 4 * SPREAD
    counts = np.bincount(which[close], minlength=MODES)
    return {"energy": energy_distance(fake, real), "to mode": float(nearest.mean()),
            "modes": int(np.sum(counts >= 0.02 * len(fake)))}


def bce(logits: jax.Array, label: float) -> jax.Array:
    """Binary cross-entropy with logits, in float32 whatever the models computed in."""
    logits = logits.astype(jnp.float32)
    return optax.sigmoid_binary_cross_entropy(logits, jnp.full_like(logits, label)).mean()


def make_step(apply_g, apply_d, tx_g, tx_d):
    """One discriminator update (losses 0 and 1), then one generator update (loss 2)."""

    def step(params_g, params_d, state_g, state_d, real, noise):
        fake = jax.lax.stop_gradient(apply_g({"params": params_g}, noise))

        def scaled(loss_fn, state, loss_id):
            def f(params):
                loss = loss_fn(params)
                return jamp.scale_loss(loss, state, loss_id=loss_id), loss
            return jax.grad(f, has_aux=True)

        g0, loss0 = scaled(lambda p: bce(apply_d({"params": p}, real), 1.0), state_d, 0)(params_d)
        g1, loss1 = scaled(lambda p: bce(apply_d({"params": p}, fake), 0.0), state_d, 1)(params_d)
        updates, state_d = tx_d.update([g0, g1, None], state_d, params_d)
        params_d = optax.apply_updates(params_d, updates)

        def generator_loss(p):  # the non-saturating loss: the discriminator should say "real"
            return bce(apply_d({"params": params_d}, apply_g({"params": p}, noise)), 1.0)

        g2, loss2 = scaled(generator_loss, state_g, 2)(params_g)
        updates, state_g = tx_g.update([None, None, g2], state_g, params_g)
        params_g = optax.apply_updates(params_g, updates)
        scales = jnp.stack([jamp.get_loss_scale(state_d, loss_id=0).loss_scale,
                            jamp.get_loss_scale(state_d, loss_id=1).loss_scale,
                            jamp.get_loss_scale(state_g, loss_id=2).loss_scale])
        return params_g, params_d, state_g, state_d, jnp.stack([loss0, loss1, loss2]), scales

    return step


def loss_scales(state_g: Any, state_d: Any) -> list[float]:
    """The scales of losses 0 and 1 (the discriminator's) and of loss 2 (the generator's), read
    from Apex's amp state dicts."""
    d, g = jamp.state_dict(state_d), jamp.state_dict(state_g)
    return [d["loss_scaler0"]["loss_scale"], d["loss_scaler1"]["loss_scale"],
            g["loss_scaler2"]["loss_scale"]]


def scale_events(start: Sequence[float], scales: np.ndarray) -> list[str]:
    """Every change of the three loss scales: a halving is an overflow of that loss's grads
    (its optimizer skipped the step), a doubling 2000 clean steps in a row (Apex's window)."""
    events, before = [], np.asarray(start)
    owner = ("discriminator", "discriminator", "generator")
    for i, now in enumerate(scales, start=1):
        for k in np.flatnonzero(now != before):
            why = (f"loss {k}'s grads overflowed: the {owner[k]}'s update skipped"
                   if now[k] < before[k] else "2000 clean steps")
            events.append(f"step {i:5d}: scale{k} {before[k]:g} -> {now[k]:g} ({why})")
        before = now
    return events


def run(steps: int = 3000, batch_size: int = 256, lr: float = 1e-3, log_every: int = 500,
        seed: int = 0, verbosity: int = 0) -> dict[str, Any]:
    """Trains the GAN at O2 and returns what it measured.

    Returns:
      A dict: `log` (one row per logged step: `step`, `losses` [3], `scales` [3],
      `quality` (`sample_quality`)), `initial` (the quality before training), `events`
      (`scale_events` of every step), `dtypes`, `skipped` (per optimizer), `state_dicts`,
      `seconds`.
    """
    g, d = MLP((64, 64, 2)), MLP((64, 64, 1))
    key_g, key_d = jax.random.split(jax.random.key(seed))
    vars_g = jax.jit(g.init)(key_g, jnp.zeros((1, NOISE)))  # one compile, not one per op
    vars_d = jax.jit(d.init)(key_d, jnp.zeros((1, 2)))
    [apply_g, apply_d], [vars_g, vars_d], [tx_g, tx_d] = jamp.initialize(
        [g.apply, d.apply], [vars_g, vars_d],
        [optax.adam(lr, b1=0.5), optax.adam(lr, b1=0.5)],
        opt_level="O2", num_losses=3, verbosity=verbosity)
    params_g, params_d = vars_g["params"], vars_d["params"]
    state_g, state_d = jax.jit(tx_g.init)(params_g), jax.jit(tx_d.init)(params_d)
    step = jax.jit(make_step(apply_g, apply_d, tx_g, tx_d))
    generate = jax.jit(lambda p, z: apply_g({"params": p}, z))

    rng = np.random.default_rng(seed)
    probe_noise = rng.standard_normal((1000, NOISE)).astype(np.float32)
    probe_real = real_samples(rng, 1000)
    fake = generate(params_g, probe_noise)
    dtypes = {"generator params": str(params_g["Dense_0"]["kernel"].dtype),
              "discriminator params": str(params_d["Dense_0"]["kernel"].dtype),
              "masters": str(jamp.master_params(state_g)["Dense_0"]["kernel"].dtype),
              "generated samples": str(fake.dtype)}
    initial = sample_quality(fake, probe_real)

    start_scales = loss_scales(state_g, state_d)
    log, history, start = [], [], time.perf_counter()
    for i in range(1, steps + 1):
        real = real_samples(rng, batch_size)
        noise = rng.standard_normal((batch_size, NOISE)).astype(np.float32)
        params_g, params_d, state_g, state_d, losses, scales = step(
            params_g, params_d, state_g, state_d, real, noise)
        history.append(scales)
        if i % log_every == 0 or i == steps:
            log.append(dict(step=i, losses=np.asarray(losses).tolist(),
                            scales=loss_scales(state_g, state_d),
                            quality=sample_quality(generate(params_g, probe_noise), probe_real)))
    seconds = time.perf_counter() - start
    skipped = {name: int(s.skipped_steps)
               for name, s in (("generator", state_g), ("discriminator", state_d))}
    return dict(log=log, initial=initial, dtypes=dtypes, skipped=skipped, seconds=seconds,
                events=scale_events(start_scales, np.asarray(jax.device_get(history))),
                state_dicts={"generator": jamp.state_dict(state_g),
                             "discriminator": jamp.state_dict(state_d)})


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--log-every", type=int, default=500)
    parser.add_argument("--verbosity", type=int, default=0,
                        help="1 prints jamp.initialize's 'Selected optimization level' block")
    args = parser.parse_args(argv)

    print(f"jax {jax.__version__} on {jax.default_backend()}: a GAN at O2 on a ring of {MODES} "
          f"Gaussians (radius {RADIUS}, std {SPREAD}); {args.steps} steps of {args.batch} "
          f"samples, num_losses=3\n")
    result = run(args.steps, args.batch, args.lr, args.log_every, verbosity=args.verbosity)
    print("dtypes: " + ", ".join(f"{k} {v}" for k, v in result["dtypes"].items()) + "\n")

    q0 = result["initial"]
    print(f"{'step':>6s} {'loss0 D real':>12s} {'loss1 D fake':>12s} {'loss2 G':>8s}  "
          f"{'scale0 (D)':>10s} {'scale1 (D)':>10s} {'scale2 (G)':>10s}  "
          f"{'energy':>7s} {'to mode':>7s} {'modes':>5s}")
    print(f"{0:6d} {'':12s} {'':12s} {'':8s}  {'':10s} {'':10s} {'':10s}  "
          f"{q0['energy']:7.3f} {q0['to mode']:7.3f} {q0['modes']:5d}")
    for row in result["log"]:
        (l0, l1, l2), (s0, s1, s2), q = row["losses"], row["scales"], row["quality"]
        print(f"{row['step']:6d} {l0:12.4f} {l1:12.4f} {l2:8.4f}  {s0:10g} {s1:10g} {s2:10g}  "
              f"{q['energy']:7.3f} {q['to mode']:7.3f} {q['modes']:5d}")
    print("\nevery change of a loss scale:")
    for line in result["events"] or ["none"]:
        print(f"  {line}")
    print(f"skipped steps (grads not finite): {result['skipped']}; training took "
          f"{result['seconds']:.1f} s (compiling included)")
    for name, sd in result["state_dicts"].items():
        print(f"jamp.state_dict of the {name}'s optimizer: {sd}")

    q1 = result["log"][-1]["quality"]
    closer = q1["energy"] < q0["energy"] and q1["to mode"] < q0["to mode"]
    print(f"\nThe generated samples {'moved toward' if closer else 'did NOT move toward'} the "
          f"real distribution: the energy distance between generated and real samples went "
          f"from {q0['energy']:.3f} to {q1['energy']:.3f}, the mean distance to the nearest "
          f"mode from {q0['to mode']:.3f} to {q1['to mode']:.3f} (the modes' std is {SPREAD}); "
          f"{q1['modes']} of {MODES} modes are covered.")
    overflows = [sum(f"scale{k} " in e and "overflowed" in e for e in result["events"])
                 for k in range(3)]
    print(f"Three loss scales, one per loss, each moved on its own: overflows of losses 0, 1, "
          f"2: {overflows[0]}, {overflows[1]}, {overflows[2]}; final scales "
          f"{', '.join(f'{s:g}' for s in result['log'][-1]['scales'])}. With num_losses=1, "
          f"one scale would have been halved on all {sum(overflows)} of these overflows.")
    return result


if __name__ == "__main__":
    main()
