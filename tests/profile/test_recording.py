"""jamp.profile.profile used as users do and misuse it: work the block does not wait for,
compiles and collected programs inside the block, labels in loops, odd names and eager
transformations, Flax's scanned and rematerialized modules, every table option, bad arguments,
and compiled HLO texts the parser must read (dynamic shapes, typed operands, GPU custom calls,
both stack-frame conventions)."""

import gc
import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

from jamp.profile import emit_nvtx, events as events_module, hlo, profile, record_function
from jamp.profile.events import EventList, FunctionEvent
from jamp.profile.trace import _ScopeRange

M, K, N = 8, 16, 32


def matmul_tanh(w, x):
    return jnp.tanh(x @ w)


W = jnp.full((K, N), 0.01, jnp.float32)
X = jnp.ones((M, K), jnp.float32)


def rows(prof):
    return {row.key: row for row in prof.key_averages()}


# --- What the profile sees -------------------------------------------------------------------

def test_work_the_block_did_not_wait_for_is_in_the_profile_and_earlier_work_is_not():
    f = jax.jit(lambda a: (a @ a) @ a)
    big = jnp.ones((256, 256))
    f(big).block_until_ready()
    for _ in range(3):
        f(big)  # dispatched before the profile, results dropped: not the block's work
    with profile() as prof:
        for _ in range(4):
            f(big)  # results dropped, never blocked on
    assert rows(prof)["jit__lambda"].count == 4
    # The profiler's own waiting leaves no rows.
    assert not [e for e in prof.events() if "barrier" in e.key]


def test_profile_inside_a_context_mesh():
    mesh = jax.make_mesh((len(jax.devices()),), ("data",))
    step = jax.jit(matmul_tanh)
    step(W, X).block_until_ready()
    with jax.set_mesh(mesh):
        with profile() as prof:
            step(W, X).block_until_ready()
    assert rows(prof)["jit_matmul_tanh"].count >= 1


def test_compiles_inside_the_block():
    with profile(with_flops=True, record_shapes=True) as prof:
        f = jax.jit(lambda a, b: a @ b)
        f(X, W).block_until_ready()  # compiled in the block
        f(W.T, X.T).block_until_ready()  # new shapes: a second program
    matmuls = sorted((e.input_shapes, e.flops) for e in prof.events() if e.flops)
    assert matmuls == [([[M, K], [K, N]], 2 * M * K * N), ([[N, K], [K, M]], 2 * N * K * M)]


def test_a_program_collected_before_the_profile_ends_is_rows_without_its_details():
    g = jax.jit(lambda a: a @ a.T + 1.0)
    g(X).block_until_ready()
    with profile(with_flops=True, record_shapes=True, profile_memory=True,
                 with_modules=True) as prof:
        g(X).block_until_ready()
        del g
        jax.clear_caches()
        gc.collect()  # its executable is gone before the profile reads the programs
    ops = [e for e in prof.events() if e.kind == "op" and e.key.startswith("jit__lambda::")]
    assert ops and not any(e.flops or e.input_shapes for e in ops)
    assert rows(prof)["jit__lambda"].count == 1


def test_counts_flops_and_self_times_through_control_flow_and_transformations():
    def f(w, x):
        c, _ = lax.scan(lambda c, _: (jnp.tanh(c @ w[:, :K]), None), x, None, length=3)
        _, c = lax.while_loop(lambda s: s[0] < 2, lambda s: (s[0] + 1, s[1] @ w[:, :K]), (0, c))
        c = lax.cond(c.sum() > 0, lambda a: a @ w[:, :K], lambda a: a, c)
        g = jax.grad(lambda w: (x @ w).sum())(w)  # d/dw only: one matmul
        v = jax.vmap(lambda r: r @ w)(x)
        return c.sum() + g.sum() + v.sum()

    step = jax.jit(f)
    step(W, X).block_until_ready()
    with profile(with_flops=True) as prof:
        for _ in range(2):
            step(W, X).block_until_ready()
    square, wide = 2 * M * K * K, 2 * M * K * N
    per_call = 3 * square + 2 * square + square + wide + wide
    assert sum(e.flops for e in prof.events()) == 2 * per_call
    assert rows(prof)["jit_f"].count == 2
    for event in prof.events():
        assert event.self_cpu_time_total >= 0, event
    assert [e.id for e in prof.events()] == list(range(len(prof.events())))


def test_sharded_jit_shard_map_and_pmap_count_every_devices_flops():
    devices = len(jax.devices())
    mesh = jax.make_mesh((devices,), ("d",))
    xs = jax.device_put(jnp.ones((devices * M, K)),
                        jax.sharding.NamedSharding(mesh, P("d")))
    mapped = jax.jit(jax.shard_map(lambda x, w: lax.psum(x @ w, "d"), mesh=mesh,
                                   in_specs=(P("d"), P()), out_specs=P()))
    pmapped = jax.pmap(lambda x, w: x @ w, in_axes=(0, None))
    stacked = jnp.ones((devices, M, K))
    mapped(xs, W).block_until_ready()
    pmapped(stacked, W).block_until_ready()
    with profile(with_flops=True) as prof:
        mapped(xs, W).block_until_ready()
        pmapped(stacked, W).block_until_ready()
    assert sum(e.flops for e in prof.events()) == 2 * (2 * devices * M * K * N)


# --- Labels ----------------------------------------------------------------------------------

def test_a_label_inside_a_loop_body_is_a_row():
    def f(w, x):
        def body(c, _):
            with record_function("in_body"):
                return jnp.tanh(c @ w), None
        return lax.scan(body, x, None, length=4)[0]

    step = jax.jit(f)
    square = jnp.full((K, K), 0.01)
    step(square, X).block_until_ready()
    with profile(with_flops=True) as prof:
        for _ in range(2):
            step(square, X).block_until_ready()
    assert rows(prof)["in_body"].count == 2  # one per program run
    label = [e for e in prof.events() if e.key == "in_body"][0]
    assert sum(m.flops for m in label.members) == 4 * 2 * M * K * K
    # It is inside its run, not a top-level event.
    assert label.parent.kind == "program"
    top = prof.key_averages().table(top_level_events_only=True)
    assert "in_body" not in top and "top-level" in top


@pytest.mark.parametrize("name", ["a/b", "step(0)", "jvp", "x->y"])
def test_labels_with_slashes_and_parentheses_inside_jit(name):
    @jax.jit
    def f(w, x):
        with record_function(name):
            return jnp.tanh(x @ w)

    f(W, X).block_until_ready()
    with profile(with_modules=True) as prof:
        f(W, X).block_until_ready()
    assert rows(prof)[name].count == 1


def test_nested_labels_and_decorators_on_host_and_jitted_functions():
    @record_function("host_fn")
    def host(x):
        return (x @ W).block_until_ready()

    @jax.jit
    @record_function("traced_fn")
    def traced(x):
        with record_function("same"):
            with record_function("same"):
                return jnp.tanh(x @ W)

    host(X)
    traced(X).block_until_ready()
    with profile() as prof:
        with record_function("outer"):
            with record_function("outer"):
                host(X)
            traced(X).block_until_ready()
    keys = rows(prof)
    assert keys["outer"].count == 2 and keys["host_fn"].count == 1
    assert keys["traced_fn"].count == 1 and keys["same"].count == 1
    for event in prof.events():
        assert event.self_cpu_time_total >= 0, event


def test_record_function_args_keep_torchs_key():
    with profile() as prof:
        with record_function("load", args="batch=3"):
            jnp.ones(3).block_until_ready()
    assert rows(prof)["load"].count == 1
    with pytest.raises(TypeError, match="args="):
        record_function("load", args=3)
    for bad in (None, 3, ""):
        with pytest.raises(TypeError, match="name="):
            record_function(bad)


def test_a_label_under_an_eager_grad_times_the_work_it_dispatches():
    def loss(w):
        with record_function("eager_grad"):
            return jnp.sin(w).sum()

    jax.grad(loss)(jnp.ones(4))
    with profile() as prof:
        jax.grad(loss)(jnp.ones(4)).block_until_ready()
    label = [e for e in prof.events() if e.key == "eager_grad"]
    assert len(label) == 1 and label[0].kind == "range" and label[0].children


def test_emit_nvtx_sizes_with_non_array_and_keyword_arguments():
    class Odd:
        shape = "not a shape"

    @emit_nvtx(record_shapes=True)
    def scaled(a, n, odd, *, scale=1.0):
        return a * n * scale

    with profile() as prof:
        scaled(jnp.ones((2, 3)), 3, Odd(), scale=jnp.ones(3)).block_until_ready()
        jax.jit(scaled, static_argnums=(1, 2))(jnp.ones(4), 2, None).block_until_ready()
    name = scaled.__qualname__
    assert {f"{name}, sizes = [[2, 3], [], []]", f"{name}, sizes = [[4], [], []]"} <= set(
        rows(prof))
    with pytest.raises(TypeError, match="name="):
        emit_nvtx(name=3)


# --- Module paths ----------------------------------------------------------------------------

def test_module_paths_of_scanned_and_rematerialized_flax_modules_hold_only_modules():
    class Layer(nn.Module):
        @nn.compact
        def __call__(self, c, _):
            return jax.nn.relu(nn.Dense(K, name="fc")(c)), None

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            layers = nn.scan(Layer, variable_axes={"params": 0},
                             split_rngs={"params": True}, length=3)
            x, _ = layers(name="layers")(x, None)
            x = nn.remat(nn.Dense)(K, name="remat_fc")(x)
            return nn.Dense(N, name="head")(x)

    model = Model()
    params = model.init(jax.random.PRNGKey(0), X)
    apply = jax.jit(model.apply)
    apply(params, X).block_until_ready()
    with profile(with_modules=True, with_flops=True) as prof:
        apply(params, X).block_until_ready()
    paths = {e.module_hierarchy for e in prof.events() if e.flops}
    assert paths == {"Model/layers/fc", "Model/remat_fc", "Model/head"}, paths
    assert sum(e.flops for e in prof.events()) == 4 * 2 * M * K * K + 2 * M * K * N


def test_scope_names_leave_out_what_jax_writes():
    cases = {
        "jit(step)/jvp(Model)/Dense_0/dot_general": ("Model", "Dense_0"),
        "jit(f)/transpose(jvp(S))/while/body/closed_call/layers/fc/dot_general":
            ("S", "layers", "fc"),
        "jit(f)/S/while/cond/lt": ("S",),
        "jit(f)/cond/branch_1_fun/mul": (),
        "jit(f)/jvp(S)/checkpoint/rematted_computation/rem/add": ("S", "rem"),
        "jit(f)/shard_map/inside/dot_general": ("inside",),
        "jit(f)/Block/jit(relu)/max": ("Block",),
        "jit(f)/transpose(jvp())/broadcast_in_dim": (),
        "jit(f)/step(0)/a/b/tanh": ("step(0)", "a", "b"),
        "layers/Block_0/reduce_max": ("layers", "Block_0"),
        "x": (),
    }
    for op_name, names in cases.items():
        assert hlo.scope_names(op_name) == names, op_name


# --- Tables and exports ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def labelled_profile():
    step = jax.jit(matmul_tanh)
    step(W, X).block_until_ready()
    with profile(record_shapes=True, with_flops=True, profile_memory=True, with_stack=True,
                 with_modules=True) as prof:
        with record_function("step"):
            step(W, X).block_until_ready()
    return prof


@pytest.mark.parametrize("sort_by", events_module.SORT_KEYS)
def test_every_sort_key_sorts_events_and_averages(labelled_profile, sort_by):
    for listing in (labelled_profile.events(), labelled_profile.key_averages()):
        text = listing.table(sort_by=sort_by, row_limit=-1)
        keys = [line.split()[0] for line in text.splitlines()[3:-2]
                if line.strip() and not line.startswith(" " * 30)]
        values = [getattr(e, sort_by) for e in
                  sorted(listing, key=lambda e: getattr(e, sort_by), reverse=True)]
        assert len(keys) == len(listing) and values == sorted(values, reverse=True)


def test_table_options(labelled_profile):
    averages = labelled_profile.key_averages()
    assert len(averages.table(row_limit=0).splitlines()) == 5  # the header and footer only
    assert averages.table(row_limit=-1) == averages.table(row_limit=len(averages))
    assert "ms" in averages.table(time_unit="ms").splitlines()[3]
    text = averages.table(header="My step")
    assert text.splitlines()[1] == "My step"
    top = averages.table(top_level_events_only=True)
    assert "step" in top and "jit_matmul_tanh" not in top
    assert averages.table(max_name_column_width=None, max_src_column_width=None,
                          max_shapes_column_width=None)
    assert str(labelled_profile) == averages.table()
    # Averages of averages, and the total, are sums.
    again = averages.key_averages()
    assert [(r.key, r.count) for r in again] == [(r.key, r.count) for r in averages]
    assert labelled_profile.total_average().flops == averages.total_average().flops == (
        2 * M * K * N)


def test_table_arguments_are_checked(labelled_profile):
    averages = labelled_profile.key_averages()
    for kwargs, error in [({"row_limit": "10"}, TypeError), ({"row_limit": 1.5}, TypeError),
                          ({"header": 3}, TypeError), ({"time_unit": "ns"}, ValueError),
                          ({"top_level_events_only": 1}, TypeError),
                          ({"max_name_column_width": 0}, ValueError),
                          ({"sort_by": "self_gpu"}, ValueError)]:
        with pytest.raises(error):
            averages.table(**kwargs)


def test_an_empty_profile(tmp_path):
    with profile(with_stack=True) as prof:
        pass
    assert len(prof.key_averages()) == 0
    assert prof.key_averages().table() == "" == str(prof) == prof.events().table()
    prof.export_chrome_trace(str(tmp_path / "trace.json"))
    trace = json.loads((tmp_path / "trace.json").read_text())
    assert not [e for e in trace["traceEvents"] if e["ph"] == "X"]
    for metric in events_module.STACK_METRICS:
        prof.export_stacks(str(tmp_path / "stacks.txt"), metric)
        assert (tmp_path / "stacks.txt").read_text() == ""
    assert prof.total_average().count == 0


def test_exports_name_the_tables_keys(labelled_profile, tmp_path):
    path = tmp_path / "trace.json"
    labelled_profile.export_chrome_trace(str(path))
    names = {e["name"] for e in json.loads(path.read_text())["traceEvents"] if e["ph"] == "X"}
    assert names == set(rows(labelled_profile))
    for metric in events_module.STACK_METRICS:
        labelled_profile.export_stacks(str(path), metric)
        for line in path.read_text().splitlines():
            assert line.rsplit(" ", 1)[0].rsplit(";", 1)[1] in names


# --- The numbers of events, by construction ----------------------------------------------------

def event(name, start, end, device_type="cpu", thread="t"):
    return FunctionEvent(id=0, name=name, kind="op", thread=thread, start_us=start,
                         end_us=end, device_type=device_type)


def test_self_time_takes_off_only_what_children_cover():
    parent = event("range", 0.0, 10.0)
    # A run that outlasts its range, and one on another thread overlapping it.
    parent.children = [event("run", 5.0, 15.0, thread="a"), event("run", 6.0, 8.0, thread="b")]
    assert parent.self_cpu_time_total == pytest.approx(5.0)
    nested = event("op", 0.0, 10.0)
    nested.children = [event("a", 1.0, 3.0), event("b", 4.0, 5.0)]
    assert nested.self_cpu_time_total == pytest.approx(7.0)


def test_single_events_have_torchs_per_call_fields_and_device_aliases():
    kernel = event("k", 0.0, 4.0, device_type="cuda")
    assert kernel.count == 1 and kernel.device_time == kernel.cuda_time == 4.0
    label = _ScopeRange(id=0, name="label", kind="range", thread="s", start_us=0.0,
                        end_us=4.0)
    label.members = [kernel, event("launch", 0.0, 1.0)]
    assert label.cuda_time_total == label.device_time_total == 4.0
    assert label.cpu_time == label.cpu_time_total == 1.0
    average = EventList([kernel]).key_averages()[0]
    assert average.calls == 1 and average.device_type == "cuda"


# --- The HLO parser --------------------------------------------------------------------------

_MODULE = '''HloModule jit_tricky, is_scheduled=true

FileNames
1 "/src/model.py"

FunctionNames
1 "layer"
2 "<module>"

FileLocations
1 {file_name_id=1 function_name_id=1 line=10}
2 {file_name_id=1 function_name_id=2 line=20}

StackFrames
%(frames)s

%%add.clone (x.1: f32[], y.1: f32[]) -> f32[] {
  %%x.1 = f32[] parameter(0)
  %%y.1 = f32[] parameter(1)
  ROOT %%add.2 = f32[] add(f32[] %%x.1, f32[] %%y.1)
}

ENTRY %%main.9 (Arg_0.1: f32[16,32], Arg_1.2: f32[32,8]) -> (f32[16,8], s32[]) {
  %%Arg_0.1 = f32[16,32]{1,0} parameter(0), metadata={op_name="x"}
  %%Arg_1.2 = f32[32,8]{1,0} parameter(1)
  %%gemm.1 = (f32[16,8]{1,0}, s8[1024]{0}) custom-call(f32[16,32]{1,0} %%Arg_0.1, f32[32,8]{1,0} %%Arg_1.2), custom_call_target="__cublas$gemm", metadata={op_name="jit(f)/jvp(Model)/Dense_0/dot_general" stack_frame_id=2}, backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"]}}}, frontend_attributes={a="b"}
  %%gemm.2 = f32[16,8]{1,0} custom-call(Arg_0.1, Arg_1.2), custom_call_target="__cublas$lt$matmul", backend_config="{\\"gemm_backend_config\\":{\\"dot_dimension_numbers\\":{\\"lhs_contracting_dimensions\\":[\\"1\\"]}}}"
  %%get-tuple-element.3 = f32[16,8]{1,0} get-tuple-element((f32[16,8]{1,0}, s8[1024]{0}) %%gemm.1), index=0
  %%all-reduce-start = f32[16,8]{1,0} all-reduce-start(f32[16,8]{1,0} %%get-tuple-element.3), channel_id=1, replica_groups={{0,1}}, to_apply=%%add.clone
  %%all-reduce-done = f32[16,8]{1,0} all-reduce-done(f32[16,8]{1,0} %%all-reduce-start)
  %%dynamic-rows = f32[<=16,8]{1,0} custom-call(f32[16,8]{1,0} %%all-reduce-done), custom_call_target="SliceToDynamic"
  %%dot.4 = f32[<=16,32]{1,0} dot(f32[<=16,8]{1,0} %%dynamic-rows, f32[32,8]{1,0} %%Arg_1.2), lhs_contracting_dims={1}, rhs_contracting_dims={1}
  %%fp8 = f8e4m3fn[16,8]{1,0} convert(%%all-reduce-done)
  %%c = s32[] constant(3)
  ROOT %%tuple.5 = (f32[16,8]{1,0}, f32[16,8]{1,0}, f32[16,8]{1,0}, f32[16,8]{1,0}, f32[16,8]{1,0}, /*index=5*/s32[]) tuple(%%all-reduce-done, %%all-reduce-done, %%all-reduce-done, %%all-reduce-done, %%all-reduce-done, /*index=5*/%%c)
}
'''


@pytest.mark.parametrize("frames", [
    "1 {file_location_id=2 parent_frame_id=0}\n2 {file_location_id=1 parent_frame_id=1}",
    # The convention that prints every parent id one higher (a root names frame 1).
    "1 {file_location_id=2 parent_frame_id=1}\n2 {file_location_id=1 parent_frame_id=2}",
])
def test_parser_reads_tricky_compiled_text(frames):
    program = hlo.parse_module(_MODULE % {"frames": frames}, "jit_tricky")
    ops = program.instructions
    gemm = ops["gemm.1"]
    assert gemm.flops == 2 * 16 * 8 * 32 and gemm.input_shapes == [[16, 32], [32, 8]]
    assert gemm.module_hierarchy == "Model/Dense_0"
    assert gemm.stack == ("/src/model.py(10): layer", "/src/model.py(20): <module>")
    assert ops["gemm.2"].flops == 2 * 16 * 8 * 32  # quoted config, operands without "%"
    assert ops["gemm.2"].operands == ("Arg_0.1", "Arg_1.2")
    assert ops["all-reduce-done"].input_shapes == [[16, 8]]
    # A dynamic dimension is read at its bound.
    assert ops["dynamic-rows"].results[0].shape == (16, 8)
    assert ops["dot.4"].flops == 2 * 16 * 32 * 8
    assert ops["dot.4"].input_shapes == [[16, 8], [32, 8]]
    assert ops["fp8"].output_bytes == 16 * 8
    assert ops["tuple.5"].operands == ("all-reduce-done",) * 5 + ("c",)
    assert ops["add.2"].computation == "add.clone" and ops["add.2"].flops == 0


def test_parser_tolerates_unbounded_and_unknown_types():
    program = hlo.parse_module(
        "ENTRY %main {\n"
        "  %a = f32[?,8]{1,0} parameter(0)\n"
        "  %b = f32[8,4]{1,0} parameter(1)\n"
        "  %d = f32[?,4]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}\n"
        "  %t = token[] after-all()\n"
        "  %conv = f32[1,4]{1,0} convolution(%b, %b), dim_labels=bad\n"
        "}\n")
    ops = program.instructions
    assert ops["d"].flops == 0 and ops["d"].output_bytes == 0
    assert ops["t"].results == ()
    assert ops["conv"].flops >= 0
