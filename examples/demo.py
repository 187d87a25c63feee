"""make demo: a byte-level GPT trained on real text at Apex's opt levels, through jamp.initialize.

The text is the Python Language Reference, which ships with Python. Five runs train the same
model from the same initialisation on the same batches with AdamW:

  * O0, O1, O2 and O3 of `jamp.initialize(model.apply, variables, optax.adamw(...))`: float32;
    float32 params with the model under autocast (float16); float16 params with float32 master
    weights; pure float16. When pure float16 diverges (a non-finite loss, ten skipped steps in
    a row, or no learning), O3 runs again with `cast_model_type=jnp.bfloat16`, and the output
    says so;
  * `jamp.autocast(loss, dtype=jnp.bfloat16)` with a dynamic loss scale inside `loss_scaled`;
  * fp8: the same, with rules that put the blocks' linear layers in fp8 (the tensorwise
    recipe, `jamp.fp8.recipe("tensorwise")`) and keep the LM head in bfloat16.

Each run computes its loss in float32 from the model's logits. The script shows a progress bar
per run, then a table (train and validation loss, skipped steps, median step time, the dtypes of
the params and of the optimizer's master weights, the dtypes of the matmuls of the compiled
training step, read from its StableHLO, and the shares of its matmul FLOPs in half precision
and in fp8, from `jamp.profile.amp_report`), a PNG plot of the loss and the loss scale per
step, and what the numbers say. A closing line is `jamp.debug.precision_report`'s on one
small batch: whether any module overflows float16 and the initial loss scale it suggests.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import re
import statistics
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm import tqdm

import jamp
from jamp.debug import precision_report
from models import ByteGPT, next_byte_loss
from text_data import batches, load_corpus, split

_DOT = re.compile(r"stablehlo\.dot_general .*: \((tensor<[^>]*>), (tensor<[^>]*>)\) -> "
                  r"(tensor<[^>]*>)")
# The fp8 run's validation loss stays this close to float32's (nats/byte).
FP8_TOLERANCE = 0.03
# With O3's static loss scale of 1, a skipped step means the grads overflowed unscaled; this
# many in a row and the pure-float16 attempt is given up.
_GIVE_UP_AFTER = 10


@dataclasses.dataclass
class Run:
    name: str
    loss: Callable  # (params, windows) -> the float32 loss
    tx: optax.GradientTransformation
    params: Any
    give_up: bool = False  # stop at a non-finite loss or _GIVE_UP_AFTER skipped steps in a row


@dataclasses.dataclass
class Result:
    name: str
    losses: list[float]  # per step, before its update
    scales: list[float]  # the loss scale each step used
    skipped: list[int]  # the steps whose update was skipped
    step_ms: float
    valid: float
    params: str
    masters: str
    state: str  # the floating dtypes of the optimizer state
    matmuls: str
    half_flops: float  # amp_report's half_flops_fraction of the training step
    casts: tuple[int, int]  # the training step's converts: (executed, bytes written)
    masters_are_params_cast: bool | None = None  # None: no separate masters
    diverged_at: int | None = None  # where a `give_up` run was given up
    scale_period: int | None = None  # a dynamic loss scale's growth interval
    fp8_flops: float = 0.0  # amp_report's fp8_flops_fraction of the training step

    @property
    def first(self) -> float:
        return self.losses[0]

    @property
    def train(self) -> float:
        """The mean loss of the last 20 steps (fewer in a short run)."""
        return float(np.mean(self.losses[-20:]))


def matmul_dtypes(stablehlo: str) -> str:
    """The dot_generals of a lowered program, counted by their operand and result types:
    `51 f16` (operands and result float16) or `12 bf16->f32`."""
    def element_type(tensor_type):  # tensor<32x64xf16> -> f16
        return tensor_type[len("tensor<"):-1].split("x")[-1]

    kinds = collections.Counter()
    for match in _DOT.finditer(stablehlo):
        a, b, out = (element_type(t) for t in match.groups())
        kinds[(a if a == b else f"{a}*{b}") + ("" if out == a == b else f"->{out}")] += 1
    return ", ".join(f"{n} {kind}" for kind, n in kinds.most_common()) or "none"


def dtypes(tree) -> str:
    """The floating dtypes in `tree`: `float16+float32`."""
    return "+".join(sorted({x.dtype.name for x in jax.tree_util.tree_leaves(tree)
                            if jnp.issubdtype(x.dtype, jnp.floating)}))


def float32_loss(apply_fn):
    """The user's loss: the model's logits, whatever their dtype, cast to float32 first."""
    def loss(params, windows):
        logits = apply_fn({"params": params}, windows[:, :-1])
        return next_byte_loss(logits.astype(jnp.float32), windows)
    return loss


def fp8_rules(recipe) -> list:
    """The blocks' linear layers in fp8, the LM head (the model's last Dense: its logits reach
    the loss unfiltered) in bfloat16."""
    return [("/ByteGPT/Dense_0", jnp.bfloat16), ("Block_*", recipe)]


def amp_run(name, model, variables, tx, opt_level, **overrides) -> Run:
    apply_fn, variables, tx = jamp.initialize(model.apply, variables, tx, opt_level=opt_level,
                                              verbosity=0, **overrides)
    return Run(name, float32_loss(apply_fn), tx, variables["params"])


def train(run: Run, args, data) -> Result:
    def step(params, opt_state, windows):
        def scaled_loss(p):
            loss = run.loss(p, windows)
            return jamp.scale_loss(loss, opt_state), loss

        (_, loss), grads = jax.value_and_grad(scaled_loss, has_aux=True)(params)
        # The optimizer unscales the grads, and skips the step if they hold inf or nan.
        updates, opt_state = run.tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    params, opt_state = run.params, run.tx.init(run.params)
    stream = batches(data[0], args.batch, args.seq, seed=1)
    windows = next(stream)
    bar = tqdm(total=args.steps, desc=f"{run.name:13s}", unit="step", dynamic_ncols=True)
    bar.set_postfix_str("compiling")
    step = jax.jit(step)
    lowered = step.lower(params, opt_state, windows)
    lowered.compile()  # here rather than in the first timed step; the calls below reuse it
    # Read from the program, not from a run: tracing only, the compile above is reused.
    report = jamp.profile.amp_report(step, params, opt_state, windows)
    losses, scales, skipped, times, streak, diverged_at = [], [], [], [], 0, None
    for i in range(args.steps):
        windows = windows if i == 0 else next(stream)
        scales.append(float(jamp.get_loss_scale(opt_state).loss_scale))
        start = time.perf_counter()
        params, opt_state, loss = step(params, opt_state, windows)
        losses.append(float(loss))  # waits for the step
        times.append(time.perf_counter() - start)
        applied = bool(opt_state.last_finite)
        streak = 0 if applied else streak + 1
        if not applied:
            skipped.append(i)
        bar.update()
        bar.set_postfix(loss=f"{losses[-1]:.3f}", scale=f"{scales[-1]:g}",
                        skipped=len(skipped), refresh=False)
        if run.give_up and (not np.isfinite(losses[-1]) or streak >= _GIVE_UP_AFTER):
            diverged_at = i + 1 - max(streak, 1)
            bar.set_postfix_str(f"diverged at step {diverged_at}: stopped")
            break
    bar.close()

    eval_loss = jax.jit(run.loss)
    valid = batches(data[1], args.batch, args.seq, seed=2)
    valid_loss = float(np.mean([eval_loss(params, next(valid))
                                for _ in range(args.valid_batches)]))
    masters = jamp.master_params(opt_state, params)
    same = None if masters is params else bool(jax.jit(equal_when_cast)(masters, params))
    return Result(run.name, losses, scales, skipped,
                  step_ms=1e3 * statistics.median(times[1:] or times), valid=valid_loss,
                  params=dtypes(params), masters="-" if same is None else dtypes(masters),
                  state=dtypes(opt_state),
                  matmuls=matmul_dtypes(lowered.as_text()),
                  half_flops=report.half_flops_fraction,
                  fp8_flops=report.fp8_flops_fraction,
                  casts=(sum(c.count for c in report.converts),
                         sum(c.bytes for c in report.converts)),
                  masters_are_params_cast=same,
                  diverged_at=diverged_at,
                  scale_period=getattr(jamp.get_loss_scale(opt_state), "period", None))


def equal_when_cast(masters, params) -> jax.Array:
    """Whether every param equals its master cast to the param's dtype."""
    same = jax.tree_util.tree_map(lambda m, p: jnp.all(m.astype(p.dtype) == p), masters, params)
    return jnp.all(jnp.stack(jax.tree_util.tree_leaves(same)))


def learned(result: Result, reference: Result) -> bool:
    """Finite throughout, and the loss fell by at least half as much as the reference's."""
    return (result.diverged_at is None and bool(np.all(np.isfinite(result.losses)))
            and result.first - result.train >= 0.5 * (reference.first - reference.train))


def table(results: list[Result]) -> str:
    rows = [("run", "params", "masters", "matmuls (dot_general types)", "half FLOPs",
             "fp8 FLOPs", "first", "train", "valid", "skipped", "step ms")]
    rows += [(r.name, r.params, r.masters, r.matmuls, f"{r.half_flops:.2f}",
              f"{r.fp8_flops:.2f}", f"{r.first:.3f}", f"{r.train:.3f}", f"{r.valid:.3f}",
              f"{len(r.skipped)}/{len(r.losses)}", f"{r.step_ms:.1f}")
             for r in results]
    widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
    return "\n".join("  ".join(cell.rjust(w) if c >= 4 else cell.ljust(w)
                               for c, (cell, w) in enumerate(zip(row, widths))).rstrip()
                     for row in rows)


def scale_story(r: Result) -> str:
    """Where a run's loss scale started, backed off and grew, and which steps it skipped."""
    kind = (f"dynamic, doubling after {r.scale_period} finite steps in a row"
            if r.scale_period else "static")
    if len(set(r.scales)) == 1:
        story = f"{r.name} {r.scales[0]:g} throughout ({kind})"
    else:
        changes = list(zip(r.scales, r.scales[1:]))
        story = (f"{r.name} {r.scales[0]:g} -> {r.scales[-1]:g} ({kind}: "
                 f"{sum(new < old for old, new in changes)} back-offs, "
                 f"{sum(new > old for old, new in changes)} growths)")
    if not r.skipped:
        return story + ", no step skipped"
    steps = ", ".join(map(str, r.skipped[:6])) + (", ..." if len(r.skipped) > 6 else "")
    return story + f", {len(r.skipped)} step(s) skipped on overflow (step {steps})"


def conclusions(results: list[Result], o3_float16: Result | None, tolerance: float) -> list[str]:
    ref = results[0]
    close = [r for r in results[1:] if abs(r.valid - ref.valid) <= tolerance]
    far = [r for r in results[1:] if r not in close]
    gaps = lambda rs: ", ".join(f"{r.name} {r.valid - ref.valid:+.3f}" for r in rs)
    lines = []
    if close:
        lines.append(f"Matching float32: {gaps(close)} nats/byte of validation loss against "
                     f"O0's {ref.valid:.3f} (within {tolerance}).")
    if far:
        lines.append(f"Not matching float32 (more than {tolerance} off O0's validation loss "
                     f"{ref.valid:.3f}): {gaps(far)}.")
    if all(learned(r, ref) for r in results):
        lo, hi = min(r.train for r in results), max(r.train for r in results)
        lines.append(f"Every run learned: the loss fell from {ref.first:.2f} at step 0 (ln 256 "
                     f"= 5.55 is a uniform guess) to {lo:.3f}"
                     + (f"-{hi:.3f}" if f"{hi:.3f}" != f"{lo:.3f}" else "")
                     + " over the last 20 steps.")
    else:
        lines.append("Did not learn (the loss fell by less than half of float32's drop): "
                     + ", ".join(r.name for r in results if not learned(r, ref)) + ".")
    lines.append("Loss scales: " + "; ".join(scale_story(r) for r in results) + ".")
    for r in results:
        if r.masters_are_params_cast is not None:
            lines.append(f"{r.name}'s params are {r.params} and its optimizer's masters "
                         f"{r.masters}; after the last step the params "
                         f"{'equal' if r.masters_are_params_cast else 'DIFFER from'} the masters "
                         f"cast to {r.params}.")
    o3 = next(r for r in results if r.name.startswith("O3"))
    if o3_float16 is None:
        lines.append(f"O3 trained in pure {o3.params} (no master weights, a static loss scale "
                     f"of {o3.scales[-1]:g}, optimizer state in {o3.state}) with "
                     f"{len(o3.skipped)} skipped steps: no bfloat16 fallback was needed.")
    else:
        f16 = o3_float16
        if f16.diverged_at is None:
            why = (f"its loss went from {f16.first:.3f} to {f16.train:.3f} in {len(f16.losses)} "
                   f"steps, against float32's {ref.train:.3f}")
        elif not np.isfinite(f16.losses[-1]):
            why = f"its loss was {f16.losses[-1]} at step {len(f16.losses) - 1}" + (
                f" (before it: {', '.join(f'{x:.3f}' for x in f16.losses[-4:-1])})"
                if len(f16.losses) > 1 else "")
        else:
            why = (f"from step {f16.diverged_at} on its grads held inf or nan even at O3's loss "
                   f"scale of {f16.scales[-1]:g}, so every update was skipped (stopped at step "
                   f"{len(f16.losses) - 1}, loss {f16.losses[-1]:.3f})")
        lines.append(f"O3 in pure float16 did not train: {why}. So O3 ran again with "
                     f"cast_model_type=jnp.bfloat16 ('{o3.name}'): train loss {o3.train:.3f}, "
                     f"float32's {ref.train:.3f}.")
    for fp8 in (r for r in results if r.name == "fp8"):
        within = abs(fp8.valid - ref.valid) <= FP8_TOLERANCE
        lines.append(f"fp8 (tensorwise in the blocks' linear layers, {fp8.fp8_flops:.0%} of "
                     f"the step's matmul FLOPs; LM head in bfloat16): validation loss "
                     f"{fp8.valid:.3f}, {fp8.valid - ref.valid:+.3f} nats/byte from float32's "
                     f"({'within' if within else 'NOT within'} {FP8_TOLERANCE}). On the CPU "
                     "the float8 GEMMs are emulated: float32 products of float8 values.")
    by_kind = collections.defaultdict(list)
    for r in results:
        by_kind[r.matmuls].append(r.name)
    lines.append("Matmuls of the compiled training step (forward and backward): "
                 + "; ".join(f"{', '.join(names)}: {kind}" for kind, names in by_kind.items())
                 + ".")
    lines.append("Read from each training step's program before it ran (jamp.profile.amp_report):"
                 " the share of its matmul FLOPs in float16 or bfloat16 was "
                 + ", ".join(f"{r.name} {r.half_flops:.2f}" for r in results)
                 + "; what casting cost per step: "
                 + ", ".join(f"{r.name} {r.casts[0]} converts writing "
                             f"{r.casts[1] / 2 ** 20:.1f} MiB" for r in results) + ".")
    fastest = min(results, key=lambda r: r.step_ms)
    lines.append(f"Median step time on {jax.default_backend()}: {fastest.name} fastest at "
                 f"{fastest.step_ms:.1f} ms; "
                 + ", ".join(f"{r.name} x{r.step_ms / fastest.step_ms:.2f}"
                             for r in results if r is not fastest)
                 + (". XLA's CPU backend computes float16 and bfloat16 by converting to float32 "
                    "around each op, so these times say little about GPUs and TPUs, where the "
                    "half types are the fast path." if jax.default_backend() == "cpu" else "."))
    return lines


def plot(results: list[Result], o3_float16: Result | None, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def running_mean(xs, window=10):
        cumulative = np.concatenate([[0.0], np.cumsum(xs)])
        ends = np.arange(1, len(xs) + 1)
        starts = np.maximum(ends - window, 0)
        return (cumulative[ends] - cumulative[starts]) / (ends - starts)

    runs = results + ([o3_float16] if o3_float16 else [])
    fig, (top, middle, bottom) = plt.subplots(
        3, 1, figsize=(10, 10), sharex=True, gridspec_kw=dict(height_ratios=[3, 2, 2]))
    reference = running_mean(results[0].losses)
    spread = 0.01
    for k, r in enumerate(runs):
        style = dict(color=f"C{k}", ls="--" if r is o3_float16 else "-",
                     lw=max(3.0 - 0.5 * k, 1.0),  # later runs drawn thinner, over earlier ones
                     label=f"{r.name} (diverged, stopped)" if r is o3_float16 else r.name)
        steps = np.arange(len(r.losses))
        smooth = running_mean(r.losses)
        top.plot(steps, r.losses, color=style["color"], lw=0.5, alpha=0.3)
        top.plot(steps, smooth, **style)
        if r is not results[0]:
            middle.plot(steps, smooth - reference[:len(steps)], **style)
            if r is not o3_float16:
                spread = max(spread, float(np.max(np.abs(smooth - reference))))
        bottom.step(steps, r.scales, where="post", **style)
        if r.skipped:
            bottom.plot(r.skipped, [r.scales[i] for i in r.skipped], "x", color=style["color"],
                        ms=8, mew=2)
    top.set(ylabel="training loss (nats/byte)",
            title="Loss per step (faint) and its 10-step running mean")
    middle.axhline(0.0, color="C0", lw=1)
    middle.set_ylim(-1.5 * spread, 1.5 * spread)  # a diverged run leaves the panel
    middle.set(ylabel="minus O0's (float32)",
               title="Running-mean loss minus float32's: how closely each run tracks it")
    bottom.set_yscale("log", base=2)
    bottom.set(ylabel="loss scale used", xlabel="step",
               title="Loss scale per step; x marks a skipped step (grads held inf or nan)")
    for ax in (top, middle, bottom):
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--valid-batches", type=int, default=8)
    parser.add_argument("--growth-interval", type=int, default=50,
                        help="finite steps before the autocast run's loss scale doubles (the "
                             "opt levels use Apex's 2000)")
    parser.add_argument("--tolerance", type=float, default=0.05,
                        help="a validation loss this close to float32's (nats/byte) matches it")
    parser.add_argument("--out", default="demo_results.png", help="where the plot is saved")
    args = parser.parse_args()

    data = split(load_corpus())
    model = ByteGPT()
    sample = next(batches(data[0], 1, args.seq, seed=0))
    variables = jax.jit(model.init)(jax.random.key(0), sample)
    adamw = optax.adamw(args.lr)
    print(f"jax {jax.__version__} on {jax.default_backend()}; {len(data[0]):,} training bytes of "
          f"the Python Language Reference; {args.steps} AdamW steps of {args.batch}x{args.seq} "
          "bytes per run\n")

    results = [train(amp_run(level, model, variables, adamw, level), args, data)
               for level in ("O0", "O1", "O2")]
    o3 = train(dataclasses.replace(amp_run("O3", model, variables, adamw, "O3"), give_up=True),
               args, data)
    o3_float16 = None
    if not learned(o3, results[0]):
        o3_float16 = o3
        print("O3 in pure float16 did not train (see below): running O3 again with "
              "cast_model_type=jnp.bfloat16", flush=True)
        o3 = train(amp_run("O3 bf16", model, variables, adamw, "O3",
                           cast_model_type=jnp.bfloat16), args, data)
    results.append(o3)
    for name, rules in (("autocast bf16", None),
                        ("fp8", fp8_rules(jamp.fp8.recipe("tensorwise")))):
        results.append(train(Run(
            name, jamp.autocast(float32_loss(model.apply), dtype=jnp.bfloat16, rules=rules),
            jamp.loss_scaled(adamw, jamp.DynamicLossScale(jnp.float32(2.0 ** 15),
                                                          period=args.growth_interval)),
            variables["params"]), args, data))

    print("\n" + table(results))
    print("\nLosses in nats per byte: first at step 0, train the mean of the last 20 steps, "
          "valid the mean over held-out text.\nmasters '-': no separate copy, the optimizer "
          "steps the params themselves.")
    print("\nWhat this run shows:")
    for line in conclusions(results, o3_float16, args.tolerance):
        print(f"  * {line}")
    plot(results, o3_float16, args.out)
    print(f"\nPlot of the loss and the loss scale per step: {args.out}")
    # One look at float16 itself: where it would overflow or flush on one small batch.
    report = precision_report(float32_loss(model.apply), variables["params"],
                              next(batches(data[0], 2, args.seq, seed=2)), dtype=jnp.float16,
                              device_type="cuda", loss_scale=2.0 ** 15)
    print(f"\nPrecision report (jamp.debug) of the float16 autocast step at loss scale 2^15, "
          f"one batch: {report.summary()}")


if __name__ == "__main__":
    main()
