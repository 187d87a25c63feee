"""jamp.profile.profile on real traces of the CPU backend: rows, counts, FLOPs, shapes, stacks,
module paths, memory, the chrome trace and the labelled ranges."""

import json
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jamp
from jamp.profile import emit_itt, emit_nvtx, profile, record_function

M, K, N, OUT = 16, 64, 128, 32
CALLS = 3


def mlp(w1, w2, x):
    hidden = jnp.tanh(x @ w1)  # the first matmul: 2*M*K*N FLOPs
    return hidden @ w2


MLP_LINE = mlp.__code__.co_firstlineno + 1
step = jax.jit(mlp)
W1 = jnp.full((K, N), 0.01, jnp.float32)
W2 = jnp.full((N, OUT), 0.01, jnp.float32)
X = jnp.ones((M, K), jnp.float32)


def run_profiled(fn, *args, calls=CALLS, **options):
    fn(*args).block_until_ready()  # compiled before the profile, as one profiles in practice
    with profile(**options) as prof:
        for _ in range(calls):
            fn(*args).block_until_ready()
    return prof


@pytest.fixture(scope="module")
def full_profile():
    return run_profiled(step, W1, W2, X, record_shapes=True, with_flops=True,
                        profile_memory=True, with_stack=True, with_modules=True)


def op_rows(prof, module="jit_mlp"):
    return [e for e in prof.key_averages() if e.key.startswith(module + "::")]


def test_rows_for_the_jitted_mlp_have_time_and_one_call_per_run(full_profile):
    rows = op_rows(full_profile)
    assert rows, [e.key for e in full_profile.key_averages()]
    for row in rows:
        assert row.count == CALLS, (row.key, row.count)
        assert row.cpu_time_total > 0 and row.self_cpu_time_total > 0
    program = {e.key: e for e in full_profile.key_averages()}["jit_mlp"]
    assert program.count == CALLS
    # A program run spans its ops: its total covers their time.
    assert program.cpu_time_total >= max(r.cpu_time_total for r in rows) / CALLS


def test_matmul_flops_are_2mnk(full_profile):
    per_run = sorted(e.flops for e in full_profile.events() if e.kind == "op" and e.flops)
    expected = sorted([2 * M * K * N, 2 * M * N * OUT] * CALLS)
    assert per_run == expected
    # ... and the averages sum them over the calls.
    assert sum(r.flops for r in op_rows(full_profile)) == CALLS * (2 * M * K * N + 2 * M * N * OUT)


def test_record_shapes_gives_operand_shapes_and_dtypes(full_profile):
    first = [e for e in full_profile.events() if e.flops == 2 * M * K * N][0]
    assert first.input_shapes == [[M, K], [K, N]]
    assert first.input_dtypes == ["float32", "float32"]
    grouped = full_profile.key_averages(group_by_input_shape=True)
    assert any(r.input_shapes == [[M, K], [K, N]] for r in grouped)
    assert "Input Shapes" in grouped.table()


def test_with_stack_points_at_the_users_line(full_profile):
    first = [e for e in full_profile.events() if e.flops == 2 * M * K * N][0]
    assert first.stack[0].endswith(f"test_profiler.py({MLP_LINE}): mlp"), first.stack
    # As torch's: averages keep stacks (and the table its Source Location) when grouped by them.
    assert "Source Location" not in full_profile.key_averages().table()
    grouped = full_profile.key_averages(group_by_stack_n=2)
    assert "Source Location" in grouped.table()
    assert any(row.stack and row.stack[0].endswith(f"({MLP_LINE}): mlp") for row in grouped)


def test_export_stacks_needs_with_stack(tmp_path):
    prof = run_profiled(step, W1, W2, X, calls=1)
    with pytest.raises(RuntimeError, match="with_stack=True"):
        prof.export_stacks(str(tmp_path / "stacks.txt"))


def test_profile_inside_jit_is_refused_and_torchs_use_device_is_accepted():
    @jax.jit
    def traced(x):
        with profile():
            return x * 2

    with pytest.raises(RuntimeError, match="nothing runs while jax.jit traces"):
        traced(X)
    with pytest.raises(TypeError, match="use_device=3"):
        profile(use_device=3)
    assert profile(use_device="cuda").use_device == "cuda"


def test_use_cpu_false_on_a_cpu_trace_warns_that_nothing_is_left():
    with pytest.warns(UserWarning, match="device events only"):
        prof = run_profiled(step, W1, W2, X, calls=1, use_cpu=False)
    assert len(prof.events()) == 0


def test_profile_memory_counts_the_bytes_ops_write(full_profile):
    first = [e for e in full_profile.events() if e.flops == 2 * M * K * N][0]
    assert first.cpu_memory_usage == M * N * 4  # its float32 [M, N] result
    program = [e for e in full_profile.events() if e.kind == "program"][0]
    # A run owns its buffers; with its ops' writes it is at least the output it returns.
    assert program.self_cpu_memory_usage >= M * OUT * 4
    assert program.cpu_memory_usage == program.self_cpu_memory_usage + sum(
        c.cpu_memory_usage for c in program.children)


def test_off_by_default_columns_are_absent():
    prof = run_profiled(step, W1, W2, X, calls=1)
    events = [e for e in prof.events() if e.kind == "op"]
    assert events and all(e.flops == 0 and not e.input_shapes and not e.stack
                          and e.cpu_memory_usage == 0 for e in events)
    text = prof.key_averages().table()
    for column in ("FLOPs", "Input Shapes", "Source Location", "CPU Mem"):
        assert column not in text


def test_table_has_torchs_columns_units_and_footer(full_profile):
    text = full_profile.key_averages().table(sort_by="self_cpu_time_total", row_limit=2)
    lines = text.splitlines()
    header = lines[1]
    for column in ("Name", "Self CPU %", "Self CPU", "CPU total %", "CPU total",
                   "CPU time avg", "CPU Mem", "Self CPU Mem", "# of Calls", "Total KFLOPs"):
        assert column in header
    rows = lines[3:-2]
    assert len([r for r in rows if r.strip() and not r.startswith(" " * 40)]) == 2
    assert re.search(r"\d+\.\d{3}(us|ms|s)\b", rows[0])
    assert lines[-1].startswith("Self CPU time total: ")
    # Sorted descending by self CPU time.
    averages = full_profile.key_averages()
    top = max(averages, key=lambda e: e.self_cpu_time_total)
    assert rows[0].split()[0] == top.key


def test_table_rejects_unknown_sort_key(full_profile):
    with pytest.raises(ValueError, match="sort_by='self_gpu'"):
        full_profile.key_averages().table(sort_by="self_gpu")


def test_chrome_trace_is_json_with_the_tables_keys(full_profile, tmp_path):
    path = tmp_path / "trace.json"
    full_profile.export_chrome_trace(str(path))
    trace = json.loads(path.read_text())
    complete = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    names = {e["name"] for e in complete}
    assert names == {row.key for row in full_profile.key_averages()}
    for event in complete:
        assert event["dur"] >= 0 and isinstance(event["ts"], float)
    matmul = [e for e in complete if e["args"].get("flops") == 2 * M * K * N]
    assert matmul and matmul[0]["args"]["Input Dims"] == [[M, K], [K, N]]


def test_export_stacks_writes_flamegraph_lines(full_profile, tmp_path):
    path = tmp_path / "stacks.txt"
    full_profile.export_stacks(str(path), "self_cpu_time_total")
    lines = path.read_text().splitlines()
    assert lines and all(re.fullmatch(r".+;jit_mlp::\S+ \d+", line) for line in lines)
    assert any(f"test_profiler.py({MLP_LINE}): mlp;" in line for line in lines)


def test_record_function_is_a_row_outside_and_inside_jit(tmp_path):
    @jax.jit
    def labelled(w1, w2, x):
        with record_function("first_layer"):
            hidden = jnp.tanh(x @ w1)
        return hidden @ w2

    labelled(W1, W2, X).block_until_ready()
    with profile() as prof:
        for _ in range(CALLS):
            with record_function("train_step"):
                labelled(W1, W2, X).block_until_ready()
    rows = {e.key: e for e in prof.key_averages()}
    assert rows["train_step"].count == CALLS
    assert rows["first_layer"].count == CALLS
    # The label inside jit is the ops under it: the first matmul and tanh, not the second.
    inner = [e for e in prof.events() if e.key == "first_layer"][0]
    assert len(inner.members) == 2 and all(m.scope == "first_layer" for m in inner.members)
    assert 0 < rows["first_layer"].cpu_time_total < rows["jit_labelled"].cpu_time_total + 1e-9
    # A host range holds the program runs dispatched in it.
    host = [e for e in prof.events() if e.key == "train_step"][0]
    assert [c.key for c in host.children] == ["jit_labelled"]
    path = tmp_path / "trace.json"
    prof.export_chrome_trace(str(path))
    names = {e["name"] for e in json.loads(path.read_text())["traceEvents"]}
    assert {"train_step", "first_layer"} <= names


@pytest.mark.parametrize("tool", [emit_nvtx, emit_itt])
def test_emit_ranges_around_calls_blocks_and_inside_jit(tool, tmp_path):
    traced = jax.jit(tool(record_shapes=True)(mlp))
    traced(W1, W2, X).block_until_ready()
    with profile() as prof:
        with tool(name="block"):
            traced(W1, W2, X).block_until_ready()
        with tool():
            jnp.ones(3).block_until_ready()
        with tool(enabled=False, name="never"):
            jnp.ones(3).block_until_ready()
    keys = {e.key for e in prof.key_averages()}
    assert "block" in keys and tool.__name__ in keys and "never" not in keys
    assert f"mlp, sizes = [[{K}, {N}], [{N}, {OUT}], [{M}, {K}]]" in keys
    path = tmp_path / "trace.json"
    prof.export_chrome_trace(str(path))
    traced_names = {e["name"] for e in json.loads(path.read_text())["traceEvents"]
                    if e["ph"] == "X"}
    assert {"block", tool.__name__, f"mlp, sizes = [[{K}, {N}], [{N}, {OUT}], [{M}, {K}]]"
            } <= traced_names


def test_with_modules_gives_flax_module_paths():
    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(OUT, name="head")(nn.relu(nn.Dense(N, name="body")(x)))

    model = Model()
    params = model.init(jax.random.PRNGKey(0), X)
    apply = jax.jit(model.apply)
    prof = run_profiled(apply, params, X, calls=1, with_modules=True, with_flops=True)
    paths = {e.module_hierarchy for e in prof.events() if e.flops}
    assert paths == {"Model/body", "Model/head"}, paths


def test_autocast_step_reports_the_compiled_programs_dtypes_and_casts():
    low = jax.jit(jamp.autocast(mlp, dtype=jnp.bfloat16))
    prof = run_profiled(low, W1, W2, X, calls=1, record_shapes=True, with_flops=True)
    compiled = low.lower(W1, W2, X).compile().as_text()
    hlo_dtypes = {"bf16": "bfloat16", "f32": "float32"}

    def result_dtype(name):
        return hlo_dtypes[re.search(rf"%{re.escape(name)} = (\w+)\[", compiled).group(1)]

    matmuls = [e for e in prof.events() if e.flops]
    assert sorted(e.flops for e in matmuls) == sorted([2 * M * K * N, 2 * M * N * OUT])
    for event in matmuls:
        op = event.key.split("::")[1]
        operands = re.search(rf"%{re.escape(op)} = .*?\((%[^)]*)\)", compiled).group(1)
        names = [n.strip().lstrip("%") for n in operands.split(",")]
        # What the backend computes in (the CPU rounds to bfloat16 and multiplies in float32).
        assert event.input_dtypes == [result_dtype(n) for n in names]
    # The casts autocast inserted ran, and the profile shows them as ops of their own.
    converts = [e.key.split("::")[1] for e in prof.events()
                if e.kind == "op" and "convert" in e.key]
    entry = compiled.split("ENTRY")[1]
    assert converts and sorted(converts) == sorted(re.findall(r"%(\S*convert\S*) = ", entry))


def test_sharded_program_counts_one_op_per_device():
    mesh = jax.make_mesh((len(jax.devices()),), ("data",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    xs = jax.device_put(jnp.ones((8 * len(jax.devices()), K)), sharding)
    sharded = jax.jit(lambda w, x: jnp.tanh(x @ w))
    prof = run_profiled(sharded, W1, xs, calls=2, with_flops=True)
    runs = [e for e in prof.events() if e.kind == "program"]
    assert len(runs) == 2 * len(jax.devices())
    flops = sum(e.flops for e in prof.events() if e.kind == "op")
    assert flops == 2 * 2 * xs.shape[0] * K * N  # two calls, each shard its rows


def test_disabled_profile_records_nothing_and_starts_no_trace(tmp_path):
    with profile(enabled=False) as prof:
        # No trace is running: JAX lets us start our own.
        jax.profiler.start_trace(str(tmp_path))
        step(W1, W2, X).block_until_ready()
        jax.profiler.stop_trace()
    assert len(prof.events()) == 0 and len(prof.key_averages()) == 0


def test_profiles_do_not_nest_and_bad_flags_are_refused():
    with profile():
        with pytest.raises(RuntimeError, match="cannot be nested"):
            with profile():
                pass
    with pytest.raises(TypeError, match="record_shapes"):
        profile(record_shapes="yes")
    with pytest.raises(RuntimeError, match="has not run yet"):
        profile().key_averages()
    with pytest.raises(TypeError, match="name="):
        record_function("")
    with pytest.raises(TypeError, match="decorates a function"):
        emit_nvtx()(3)


def test_profile_stops_its_trace_when_the_block_raises(tmp_path):
    with pytest.raises(ZeroDivisionError):
        with profile():
            1 / 0
    jax.profiler.start_trace(str(tmp_path))  # would fail if the profile's trace were running
    jax.profiler.stop_trace()


def test_key_averages_groups_by_stack_prefix(full_profile):
    grouped = full_profile.key_averages(group_by_stack_n=1)
    assert all(len(row.stack) <= 1 for row in grouped)
    with pytest.raises(ValueError, match="group_by_stack_n"):
        full_profile.key_averages(group_by_stack_n=-1)


def test_total_average_sums_every_event(full_profile):
    total = full_profile.total_average()
    events = full_profile.events()
    assert total.key == "Total"
    np.testing.assert_allclose(total.self_cpu_time_total,
                               sum(e.self_cpu_time_total for e in events))
    assert total.flops == sum(e.flops for e in events)


def test_autograd_profiler_has_torchs_names_and_imports():
    import importlib
    module = importlib.import_module("jamp.autograd.profiler")  # torch's import works
    assert module is jamp.autograd.profiler
    for name in ("profile", "record_function", "emit_nvtx", "emit_itt", "EventList",
                 "FunctionEvent", "FunctionEventAvg"):
        assert getattr(module, name) is getattr(jamp.profile, name)


# A GPU trace, written as the XSpace JAX's profiler records on a GPU (no GPU here): host
# launches carry their op's stats; kernels carry them as XLA's encoded annotation, or nothing
# (a library kernel outside XLA's annotations).
GPU_XSPACE = """
planes {
  id: 1 name: "/host:CPU"
  lines { id: 1 name: "python" timestamp_ns: 0
    events { metadata_id: 1 offset_ps: 0 duration_ps: 20000000 } }
  lines { id: 2 name: "launcher" timestamp_ns: 0
    events { metadata_id: 2 offset_ps: 1000000 duration_ps: 1000000
      stats { metadata_id: 1 str_value: "fusion.3" }
      stats { metadata_id: 2 str_value: "jit_step" }
      stats { metadata_id: 3 int64_value: 7 }
      stats { metadata_id: 4 int64_value: 42 } } }
  event_metadata { key: 1 value { id: 1 name: "step" } }
  event_metadata { key: 2 value { id: 2 name: "ThunkLaunch" } }
  stat_metadata { key: 1 value { id: 1 name: "hlo_op" } }
  stat_metadata { key: 2 value { id: 2 name: "hlo_module" } }
  stat_metadata { key: 3 value { id: 3 name: "program_id" } }
  stat_metadata { key: 4 value { id: 4 name: "run_id" } }
}
planes {
  id: 2 name: "/device:GPU:0"
  lines { id: 1 name: "Stream #13(Compute)" timestamp_ns: 0
    events { metadata_id: 1 offset_ps: 3000000 duration_ps: 5000000
      stats { metadata_id: 1 str_value: "XlaModule:#hlo_module=jit_step,program_id=7#" }
      stats { metadata_id: 2 str_value: "fusion.3" } }
    events { metadata_id: 2 offset_ps: 9000000 duration_ps: 2000000 } }
  event_metadata { key: 1 value { id: 1 name: "loop_fusion_kernel" } }
  event_metadata { key: 2 value { id: 2 name: "cutlass_gemm_kernel" } }
  stat_metadata { key: 1 value { id: 1 name: "level 0" } }
  stat_metadata { key: 2 value { id: 2 name: "hlo_op" } }
}
"""


def test_a_gpu_trace_gives_device_times_and_torchs_device_columns():
    from jamp.profile import trace
    data = jax.profiler.ProfileData.from_text_proto(GPU_XSPACE)
    events, device = trace.read_events(data, trace.Options(), {"step"}, set())
    assert device == "cuda"
    rows = {row.key: row for row in events.key_averages()}
    op = rows["jit_step::fusion.3"]
    assert op.count == 1  # the launch; its kernel is the device side of the same call
    assert op.cpu_time_total == pytest.approx(1.0) and op.device_time_total == pytest.approx(5.0)
    library = rows["cutlass_gemm_kernel"]
    assert library.count == 1 and library.device_time_total == pytest.approx(2.0)
    assert rows["step"].count == 1 and rows["jit_step"].count == 1
    text = events.key_averages().table(sort_by="self_cuda_time_total")
    assert {"Self CUDA", "Self CUDA %", "CUDA total", "CUDA time avg"} <= {
        c.strip() for c in re.split(r"\s{2,}", text.splitlines()[1])}
    assert text.splitlines()[3].split()[0] == "jit_step::fusion.3"
    assert [line for line in text.splitlines() if line][-1] == "Self CUDA time total: 7.000us"
