"""What loss scaling costs per training step, on a Flax transformer block stack.

Prints, measured side by side in one process (shuffled interleaved rounds; the median of the
per-round ratios, with their quartiles and the median's 95% interval), the jitted train step
time of each candidate over plain `optax.adam` without any scaling:
  * `jamp.loss_scaled(adam)`: scale the loss, unscale, check, skip or step, adjust
    (target <= 1.03 on the CPU);
  * `jamp.loss_scaled(adam, skip="cond")`: the same, with the inner update under a `lax.cond`
    instead of selects (the choice for donated buffers);
  * `optax.apply_if_finite(adam)`: the finiteness guard alone, no scaling;
  * flax's `DynamicScale` + adam, with the params and the optimizer state selected by
    `jnp.where` on the finite flag, as Flax's examples do.

`--donate` donates params and optimizer state to each jitted step (as a donated Flax TrainState
does). Every candidate that keeps or drops the step with selects then makes XLA copy the old
optimizer state each step; `skip="cond"` does not (see docs/scaler.md).

Run: python benchmarks/scaler_overhead.py [--quick] [--donate]
"""

from __future__ import annotations

import argparse

import jax
import optax
from flax.training.dynamic_scale import DynamicScale

import jamp
from common import print_ratios, time_side_by_side, train_step_arguments, transformer_problem


def build_steps(loss, adam, donate=False):
    """A jitted `(params, state, tokens) -> (params, state)` for each candidate."""

    def plain(params, state, tokens):
        grads = jax.grad(loss)(params, tokens)
        updates, state = adam.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    def loss_scaled_step(tx):
        def step(params, state, tokens):
            ls = jamp.get_loss_scale(state)
            grads = jax.grad(lambda p: ls.scale(loss(p, tokens)))(params)
            updates, state = tx.update(grads, state, params)
            return optax.apply_updates(params, updates), state
        return step

    scaled_tx = jamp.loss_scaled(adam)
    cond_tx = jamp.loss_scaled(adam, skip="cond")

    guarded_tx = optax.apply_if_finite(adam, max_consecutive_errors=1_000_000)

    def apply_if_finite(params, state, tokens):
        grads = jax.grad(loss)(params, tokens)
        updates, state = guarded_tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    def flax_dynamic_scale(params, state, tokens):
        ds, opt_state = state
        ds, finite, _, grads = ds.value_and_grad(loss)(params, tokens)
        updates, new_opt_state = adam.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        params = jamp.select_tree(finite, new_params, params)
        opt_state = jamp.select_tree(finite, new_opt_state, opt_state)
        return params, (ds, opt_state)

    inits = {
        "optax.adam (no scaling)": adam.init,
        "jamp.loss_scaled(adam)": scaled_tx.init,
        "jamp.loss_scaled(adam, skip='cond')": cond_tx.init,
        "optax.apply_if_finite(adam)": guarded_tx.init,
        "flax DynamicScale + adam": lambda p: (DynamicScale(), adam.init(p)),
    }
    steps = {
        "optax.adam (no scaling)": plain,
        "jamp.loss_scaled(adam)": loss_scaled_step(scaled_tx),
        "jamp.loss_scaled(adam, skip='cond')": loss_scaled_step(cond_tx),
        "optax.apply_if_finite(adam)": apply_if_finite,
        "flax DynamicScale + adam": flax_dynamic_scale,
    }
    donate_argnums = (0, 1) if donate else ()
    return {name: (inits[name], jax.jit(fn, donate_argnums=donate_argnums))
            for name, fn in steps.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # Many short rounds: one step of each candidate per round keeps the two sides of a paired
    # ratio a few milliseconds apart, and 500 of them narrow the median's 95% interval to about
    # +-1% on a noisy shared machine (41 rounds of 3 steps gave medians from x0.99 to x1.05).
    train_step_arguments(parser, rounds=500)
    parser.add_argument("--donate", action="store_true",
                        help="donate params and optimizer state to the jitted steps")
    args = parser.parse_args()
    loss, init_params, tokens = transformer_problem(args)

    adam = optax.adam(1e-3)
    candidates = {}
    for name, (init, step) in build_steps(loss, adam, args.donate).items():
        # Each candidate trains its own copy, threading its state step after step.
        carry = {"params": jax.tree_util.tree_map(lambda x: x.copy(), init_params)}
        carry["state"] = init(carry["params"])

        def run(step=step, carry=carry):
            carry["params"], carry["state"] = step(carry["params"], carry["state"], tokens)
            return carry["params"]

        candidates[name] = run

    print(f"jax {jax.__version__} on {jax.devices()[0].platform}; transformer width "
          f"{args.width}, depth {args.depth}, batch {args.batch}x{args.seq}"
          f"{', buffers donated' if args.donate else ''}")
    times = time_side_by_side(candidates, rounds=args.rounds, steps=args.steps)
    print_ratios(f"Train step time over plain adam (median of {args.rounds} paired rounds, "
                 f"quartiles, 95% CI of the median):", times,
                 baseline="optax.adam (no scaling)",
                 # The target is set for the usual step, without donation.
                 targets={} if args.donate else {"jamp.loss_scaled(adam)": 1.03})


if __name__ == "__main__":
    main()
