"""make demo: train a byte-level GPT on real text in float32 and in mixed precision.

The text is the Python Language Reference (shipped with Python). Each run trains the same model
from the same initialisation on the same batches; the script prints train and validation loss,
the median step time, and what ran in which dtype (read from the compiled program).
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jamp
from models import ByteGPT, next_byte_loss
from text_data import batches, load_corpus, split


def matmul_dtypes(fn, *args) -> dict[str, int]:
    """How many dot_general ops of the lowered program run in each operand dtype."""
    counts: dict[str, int] = {}
    for line in jax.jit(fn).lower(*args).as_text().splitlines():
        if "stablehlo.dot_general" in line:
            operand_type = line.rsplit(":", 1)[1].split("->")[0]
            dtype = operand_type.split("x")[-1].split(">")[0]
            counts[dtype] = counts.get(dtype, 0) + 1
    return counts


def train(name, loss_fn, params, args, data):
    tx = optax.adamw(args.lr)
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, windows):
        loss, grads = jax.value_and_grad(loss_fn)(params, windows)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    eval_loss = jax.jit(loss_fn)
    train_data, valid_data = data
    stream = batches(train_data, args.batch, args.seq, seed=1)
    times, losses = [], []
    for i in range(args.steps):
        windows = next(stream)
        start = time.perf_counter()
        params, opt_state, loss = step(params, opt_state, windows)
        loss.block_until_ready()
        if i > 0:  # the first step compiles
            times.append(time.perf_counter() - start)
        losses.append(float(loss))
    valid = batches(valid_data, args.batch, args.seq, seed=2)
    valid_loss = float(np.mean([eval_loss(params, next(valid)) for _ in range(8)]))
    return dict(name=name, train=float(np.mean(losses[-20:])), valid=valid_loss,
                step_ms=1e3 * statistics.median(times), first=losses[0])


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args()

    data = split(load_corpus())
    model = ByteGPT()
    windows = next(batches(data[0], args.batch, args.seq, seed=0))
    params = model.init(jax.random.key(0), windows[:, :-1])

    def fp32_loss(params, windows):
        return next_byte_loss(model.apply(params, windows[:, :-1]), windows)

    # jmp-style mixed precision: float32 master params, bfloat16 compute, float32 loss.
    policy = jamp.get_policy("params=float32,compute=bfloat16,output=float32")

    def policy_loss(params, windows):
        logits = model.apply(policy.cast_to_compute(params), windows[:, :-1])
        return next_byte_loss(policy.cast_to_output(logits), windows)

    runs = [("float32", fp32_loss), (f"policy {policy}", policy_loss)]
    print(f"jax {jax.__version__} on {jax.default_backend()}; {len(data[0]):,} training bytes; "
          f"{args.steps} steps of {args.batch}x{args.seq} bytes\n")
    results = []
    for name, loss_fn in runs:
        print(f"{name:30s} matmuls by dtype: {matmul_dtypes(jax.grad(loss_fn), params, windows)}")
        results.append(train(name, loss_fn, params, args, data))
    print(f"\n{'run':30s} {'first loss':>10s} {'train loss':>10s} {'valid loss':>10s} "
          f"{'step ms':>8s}")
    for r in results:
        print(f"{r['name']:30s} {r['first']:10.3f} {r['train']:10.3f} {r['valid']:10.3f} "
              f"{r['step_ms']:8.1f}")
    print("\nLosses are nats per byte (log 256 = 5.55 for a uniform guess). On a CPU, XLA emulates "
          "half precision, so mixed precision is not faster here; the point is equal loss.")


if __name__ == "__main__":
    main()
