"""What the profiler reads from compiled HLO text (`jamp.profile.hlo`): the module path in an
op name, and programs the parser must read (dynamic shapes, typed operands, GPU custom calls,
both stack-frame conventions)."""

import pytest
from jax.extend.core.primitives import closed_call_p

from jamp.profile import hlo


# The name the running jax gives closed_call (`eval_jaxpr` from jax 0.11), as its op names
# carry it.
CLOSED_CALL = closed_call_p.name


def test_scope_names_leave_out_what_jax_writes():
    cases = {
        "jit(step)/jvp(Model)/Dense_0/dot_general": ("Model", "Dense_0"),
        f"jit(f)/transpose(jvp(S))/while/body/{CLOSED_CALL}/layers/fc/dot_general":
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
