"""What sharding the training state saves, and what a half-precision FSDP step moves.

The training state of `examples/multihost.py` (the demo's byte-level GPT at O2 through
`jamp.initialize`: float16 params, float32 master weights, AdamW's two float32 moments, the
loss scale and the counters) on 8 devices, two ways:

  * replicated: every device holds all of it (data parallelism);
  * sharded (FSDP): each array split over the 8 devices along its largest dimension that 8
    divides (`multihost.fsdp_shardings`), the scalars replicated.

Prints the bytes of the params and of the optimizer state that one device holds, from the
arrays' own shards, and the ratio sharded / replicated against the target <= 1/8 + 5%. Then
the bytes the FSDP training step all-gathers, read from the compiled (partitioned) program:
at O2 the float16 params are made from the float32 masters shard by shard, so the step gathers
float16; at O1 autocast's casts of the float32 params run on the shards, before the gathers,
too; at O0 it gathers float32. Byte counts, not timings: the same on every run.

Run: python benchmarks/sharded_memory.py [--quick]   (8 CPU devices are made when none are)
"""

from __future__ import annotations

import argparse
import pathlib
import re
import sys
from typing import Callable

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))
import multihost  # noqa: E402  (first: it asks XLA for 8 CPU devices before jax starts)

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # noqa: E402

from jamp.profile import hlo  # noqa: E402

TARGET = 1 / 8 * 1.05
_ALL_GATHER = re.compile(r"= (\w+)\[([\d,]*)\]\S* all-gather(?:-start)?\(")


def device_bytes(tree, device) -> int:
    """Bytes of the shards of `tree`'s arrays that `device` holds."""
    return sum(shard.data.nbytes for leaf in jax.tree_util.tree_leaves(tree)
               for shard in leaf.addressable_shards if shard.device == device)


def all_gather_bytes(compiled_text: str) -> dict[str, int]:
    """Bytes each element type's all-gathers produce per device, in a compiled program."""
    found: dict[str, int] = {}
    for kind, dims in _ALL_GATHER.findall(compiled_text):
        array, = hlo.parse_types(f"{kind}[{dims}]")
        found[kind] = found.get(kind, 0) + array.nbytes
    return found


def training(model_args: list[str], amp: str, state: str, mesh) -> tuple[dict, Callable]:
    """The placed training state for one set-up, and a function that compiles its step and
    returns the compiled program's text."""
    args = multihost.parse_args(model_args + ["--amp", amp, "--state", state])
    apply_fn, tx, placed, shardings = multihost.setup(args, mesh)
    by_batch, replicated = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())
    step = jax.jit(multihost.make_step(apply_fn, tx, 1),
                   in_shardings=(shardings, by_batch, by_batch),
                   out_shardings=(shardings, replicated))
    windows = jax.ShapeDtypeStruct((args.batch, args.seq + 1), np.int32, sharding=by_batch)
    weights = jax.ShapeDtypeStruct((args.batch,), np.float32, sharding=by_batch)
    return placed, lambda: step.lower(placed, windows, weights).compile().as_text()


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smaller model, and no O1")
    args = parser.parse_args(argv)
    model = (["--width", "64", "--depth", "1", "--seq", "16", "--batch", "8"] if args.quick
             else ["--width", "256", "--depth", "4", "--seq", "128", "--batch", "16"])
    devices = jax.devices()
    if len(devices) != 8:
        raise SystemExit(f"needs 8 devices, found {len(devices)}")
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    print(f"jax {jax.__version__}, {len(devices)} {devices[0].platform} devices; the training "
          f"state of examples/multihost.py {' '.join(model)} at O2\n")

    runs = {(amp, state): training(model, amp, state, mesh)
            for amp, state in [("O2", "replicated"), ("O2", "fsdp"), ("O0", "fsdp")]
            + ([] if args.quick else [("O1", "fsdp")])}
    held = {state: {part: device_bytes(runs["O2", state][0][part], devices[0])
                    for part in ("params", "opt_state")}
            for state in ("replicated", "fsdp")}
    print(f"  {'bytes on one device':32s}{'replicated':>14s}{'sharded':>14s}{'ratio':>9s}")
    ratios = {}
    for part, name in (("params", "params (float16)"),
                       ("opt_state", "optimizer state (masters, Adam)"),
                       (None, "params + optimizer state")):
        rep, fsdp = ((held[s][part] for s in held) if part else
                     (sum(held[s].values()) for s in held))
        ratios[name] = fsdp / rep
        print(f"  {name:32s}{rep:>14,d}{fsdp:>14,d}{fsdp / rep:>9.4f}")
    total = ratios["params + optimizer state"]
    print(f"\nsharded over replicated, params + optimizer state: {total:.4f} (target <= "
          f"{TARGET:.4f}, 1/8 + 5%): {'PASS' if total <= TARGET else 'FAIL'}\n")

    gathered = {amp: all_gather_bytes(compile_step())
                for (amp, state), (_, compile_step) in sorted(runs.items()) if state == "fsdp"}
    base = sum(gathered["O0"].values())
    print(f"  {'all-gathers of one FSDP step':34s}{'bytes':>10s}{'ratio':>8s}   by type")
    for amp, what in (("O0", "float32 params"), ("O1", "float32 params, autocast"),
                      ("O2", "float16 params, f32 masters")):
        if amp not in gathered:
            continue
        kinds = ", ".join(f"{k} {v:,d}" for k, v in sorted(gathered[amp].items()))
        total_bytes = sum(gathered[amp].values())
        print(f"  {amp + ' (' + what + ')':34s}{total_bytes:>10,d}{total_bytes / base:>8.3f}"
              f"   {kinds}")
    return dict(held=held, ratios=ratios, gathered=gathered)


if __name__ == "__main__":
    main()
