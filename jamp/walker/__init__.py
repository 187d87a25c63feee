"""One walker over jaxprs, for every pass of jamp that reads or re-runs a program.

- `evaluate`: evaluators re-run a program with something changed at each equation (autocast's
  dtypes, the debugger's float32 shadow and probes, anomaly mode's checks): one loop with a rule
  table per interpreter.
- `control_flow`: the higher-order helpers that evaluate a body under an interpreter's rules and
  rebuild the same control flow around it (scan, while, cond, remat, custom_jvp/custom_vjp,
  shard_map, jit).
- `walk`: analyses read a program without running it (the AMP tally, `primitive_names`,
  `jamp.autograd.dependence`'s `contains`): one walk that yields each equation with the
  equations around it and how many times it runs. Passes that follow values through bodies
  (autocast's dataflow plans, dependence's flow) keep their own loops over values.
"""

__all__: list[str] = []
