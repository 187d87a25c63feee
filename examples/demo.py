"""make demo: train a byte-level GPT on real text in float32 and under jamp's mixed precision.

The text is the Python Language Reference, which ships with Python. Three runs train the same
model from the same initialisation on the same batches with AdamW:

  * float32, no mixed precision;
  * `jamp.autocast(loss, dtype=bfloat16)` with jmp's `DynamicLossScale` inside `loss_scaled`;
  * `jamp.autocast(loss, device_type="cuda", dtype=float16)` (the GPU recipe) with torch's
    `GradScaler` semantics inside `loss_scaled`.

For each run the script prints which dtypes the compiled grad step computes in (read from its
StableHLO), the train and validation loss, the median step time and the loss-scale history:
every growth, and every step skipped because float16 overflowed.
"""

from __future__ import annotations

import argparse
import collections
import re
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jamp
from models import ByteGPT, next_byte_loss
from text_data import batches, load_corpus, split

_OP_TYPE = re.compile(r"stablehlo\.(dot_general|convolution|exponential|log|reduce)\b.*?"
                      r"tensor<[^>]*?x?(bf16|f16|f32|f64)>")


def op_dtypes(fn, *args) -> dict[str, dict[str, int]]:
    """Counts, per op kind, of the dtype of its first operand in the lowered program."""
    counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for line in jax.jit(fn).lower(*args).as_text().splitlines():
        match = _OP_TYPE.search(line)
        if match:
            counts[match.group(1)][match.group(2)] += 1
    return {op: dict(c) for op, c in sorted(counts.items())}


def train(run, params, args, data):
    loss_fn, tx = run["loss"], run["tx"]
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, windows):
        scale = jamp.get_loss_scale(opt_state)
        # Grads of the scaled loss; loss_scaled unscales them, checks them and skips bad steps.
        scaled_loss, grads = jax.value_and_grad(
            lambda p: scale.scale(loss_fn(p, windows)))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        loss = scale.unscale(scaled_loss)
        return optax.apply_updates(params, updates), opt_state, loss, scale.loss_scale

    eval_loss = jax.jit(loss_fn)
    stream = batches(data[0], args.batch, args.seq, seed=1)
    times, losses, history = [], [], []
    for i in range(args.steps):
        windows = next(stream)
        start = time.perf_counter()
        params, opt_state, loss, scale_used = step(params, opt_state, windows)
        loss.block_until_ready()
        if i > 0:  # the first call compiles
            times.append(time.perf_counter() - start)
        new_scale = float(jamp.get_loss_scale(opt_state).loss_scale)
        applied = bool(opt_state.last_finite)
        history.append((i, float(scale_used), new_scale, applied))
        if applied:
            losses.append(float(loss))
    valid = batches(data[1], args.batch, args.seq, seed=2)
    valid_loss = float(np.mean([eval_loss(params, next(valid)) for _ in range(8)]))
    return dict(name=run["name"], first=losses[0], train=float(np.mean(losses[-20:])),
                valid=valid_loss, step_ms=1e3 * statistics.median(times), history=history,
                skipped=int(opt_state.skipped_steps), total=int(opt_state.total_steps))


def scale_events(history) -> list[str]:
    """The steps where the loss scale changed, or an update was skipped."""
    events = [f"step {history[0][0]:4d}: starts at {history[0][1]:g}"]
    for i, used, new, applied in history:
        if not applied:
            events.append(f"step {i:4d}: grads overflowed at {used:g}: update skipped, "
                          f"scale backed off to {new:g}")
        elif new != used:
            events.append(f"step {i:4d}: grew to {new:g}")
    return events


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--growth-interval", type=int, default=50,
                        help="finite steps before the scale doubles (torch's default is 2000; "
                             "shorter here so that a short run shows the dynamics)")
    args = parser.parse_args()

    data = split(load_corpus())
    model = ByteGPT()
    windows = next(batches(data[0], args.batch, args.seq, seed=0))
    params = model.init(jax.random.key(0), windows[:, :-1])

    def loss(params, windows):
        return next_byte_loss(model.apply(params, windows[:, :-1]), windows)

    adamw = optax.adamw(args.lr)
    runs = [
        dict(name="float32", loss=loss, tx=jamp.loss_scaled(adamw, jamp.NoOpLossScale())),
        dict(name="autocast bfloat16 + DynamicLossScale",
             loss=jamp.autocast(loss, dtype=jnp.bfloat16),
             tx=jamp.loss_scaled(adamw, jamp.DynamicLossScale(
                 jnp.float32(2.0 ** 15), period=args.growth_interval))),
        # float16 with the GPU's op table (torch's CUDA lists: softmax, exp, log and sums in
        # float32), the recipe float16 needs; on a CPU, XLA emulates the float16 arithmetic.
        dict(name="autocast float16 + GradScaler",
             loss=jamp.autocast(loss, device_type="cuda", dtype=jnp.float16),
             tx=jamp.loss_scaled(adamw, jamp.GradScaler(
                 init_scale=2.0 ** 16, growth_interval=args.growth_interval))),
    ]

    print(f"jax {jax.__version__} on {jax.default_backend()}; {len(data[0]):,} training bytes of "
          f"the Python Language Reference; {args.steps} AdamW steps of {args.batch}x{args.seq} "
          "bytes\n")
    print("What the compiled grad step computes in (ops by the dtype of their first operand):")
    for run in runs:
        print(f"  {run['name']:38s} {op_dtypes(jax.grad(run['loss']), params, windows)}")

    results = []
    for run in runs:
        print(f"\ntraining: {run['name']} ...", flush=True)
        results.append(train(run, params, args, data))
        for line in scale_events(results[-1]["history"]):
            print(f"  {line}")

    print(f"\n{'run':38s} {'first loss':>10s} {'train loss':>10s} {'valid loss':>10s} "
          f"{'skipped':>8s} {'step ms':>8s}")
    for r in results:
        print(f"{r['name']:38s} {r['first']:10.4f} {r['train']:10.4f} {r['valid']:10.4f} "
              f"{r['skipped']:4d}/{r['total']:<3d} {r['step_ms']:8.1f}")
    print("\nLosses are nats per byte (ln 256 = 5.55 for a uniform guess). A skipped step left "
          "params and optimizer state untouched. On a CPU, XLA emulates float16 and bfloat16 "
          "arithmetic\n(converting to float32 and back around each op), so mixed precision is no "
          "faster there and its step times above pay for the emulation; on GPUs and TPUs it "
          "is the fast path.\nWhat the CPU shows is that the losses match.")


if __name__ == "__main__":
    main()
