"""What the profiler needs to know about a compiled program, read from its HLO text.

A JAX trace names what ran only by HLO module, program id and HLO instruction (`ynn_fusion.1`,
`dot.3`, a GPU kernel's `fusion.12`). The compiled program says the rest: each instruction's
result and operand shapes and dtypes, the matmul and convolution FLOPs inside it, the
`jax.named_scope` path it came from (Flax linen module paths) and the user's source line.

`ProgramCatalog` finds the live compiled programs (`jamp.transforms._jax_internals`), parses the
ones a trace mentions, and answers by (module name, program id, instruction name).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from typing import Iterable, Sequence

import numpy as np

from jamp.transforms import _jax_internals as jx

# HLO element types by their text names; `pred` is a bool, the rest are numeric.
_DTYPE_NAMES = {
    "pred": "bool", "s4": "int4", "s8": "int8", "s16": "int16", "s32": "int32", "s64": "int64",
    "u4": "uint4", "u8": "uint8", "u16": "uint16", "u32": "uint32", "u64": "uint64",
    "f16": "float16", "bf16": "bfloat16", "f32": "float32", "f64": "float64",
    "c64": "complex64", "c128": "complex128", "f8e4m3fn": "float8_e4m3fn",
    "f8e5m2": "float8_e5m2", "f8e4m3fnuz": "float8_e4m3fnuz", "f8e5m2fnuz": "float8_e5m2fnuz",
    "f8e4m3b11fnuz": "float8_e4m3b11fnuz", "f8e4m3": "float8_e4m3", "f8e3m4": "float8_e3m4",
}
_BITS = {"bool": 8, "int4": 4, "uint4": 4, "int8": 8, "uint8": 8, "int16": 16, "uint16": 16,
         "int32": 32, "uint32": 32, "int64": 64, "uint64": 64, "float16": 16, "bfloat16": 16,
         "float32": 32, "float64": 64, "complex64": 64, "complex128": 128}

_ARRAY_RE = re.compile(r"([a-z][a-z0-9]*)\[([0-9,]*)\]")
_INSTRUCTION_RE = re.compile(r"^\s*(?:ROOT\s+)?%?(?P<name>[^\s=]+)\s*=\s*(?P<rest>.*)$")
_COMPUTATION_RE = re.compile(r"^(?:ENTRY\s+)?%?(?P<name>[^\s(]+)\s*\(.*\{\s*$")
_OPERAND_RE = re.compile(r"%([^\s,()]+)")
_DIMS_RE = r"{key}=\{{([0-9,]*)\}}"


@dataclasses.dataclass(frozen=True)
class ArrayType:
    """One array in an HLO shape: its dtype name (numpy's spelling) and dimensions."""

    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * _BITS.get(self.dtype, 0) // 8


@dataclasses.dataclass
class Instruction:
    """An HLO instruction as the profiler reports it."""

    name: str
    opcode: str
    results: tuple[ArrayType, ...]
    operands: tuple[str, ...]
    attributes: str
    computation: str
    operand_types: tuple[ArrayType, ...] = ()
    flops: int = 0
    scope: str = ""
    stack: tuple[str, ...] = ()

    @property
    def input_shapes(self) -> list[list[int]]:
        return [list(t.shape) for t in self.operand_types]

    @property
    def input_dtypes(self) -> list[str]:
        return [t.dtype for t in self.operand_types]

    @property
    def output_bytes(self) -> int:
        return sum(t.nbytes for t in self.results)


def parse_types(text: str) -> tuple[ArrayType, ...]:
    """The arrays of an HLO shape (`f32[16,128]{1,0}`, a tuple of them, `s32[]`)."""
    found = []
    for kind, dims in _ARRAY_RE.findall(text):
        dtype = _DTYPE_NAMES.get(kind)
        if dtype is None:  # token[], opaque types: no data
            continue
        found.append(ArrayType(dtype, tuple(int(d) for d in dims.split(",") if d)))
    return tuple(found)


def _split_shape(rest: str) -> tuple[str, str]:
    """`rest` of an instruction line split into its result shape and what follows."""
    if rest.startswith("("):  # a tuple shape: up to its matching parenthesis
        depth = 0
        for i, char in enumerate(rest):
            depth += {"(": 1, ")": -1}.get(char, 0)
            if depth == 0:
                return rest[:i + 1], rest[i + 1:].lstrip()
    shape, _, after = rest.partition(" ")
    return shape, after


def _matching_paren(text: str, start: int) -> int:
    depth = 0
    for i in range(start, len(text)):
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        if depth == 0:
            return i
    return len(text)


def _dims(attributes: str, key: str) -> list[int]:
    match = re.search(_DIMS_RE.format(key=re.escape(key)), attributes)
    return [int(d) for d in match.group(1).split(",") if d] if match else []


def _quoted(attributes: str, key: str) -> str | None:
    match = re.search(re.escape(key) + r'="((?:[^"\\]|\\.)*)"', attributes)
    return match.group(1) if match else None


def _number(attributes: str, key: str) -> int | None:
    match = re.search(r"\b" + re.escape(key) + r"=(\d+)", attributes)
    return int(match.group(1)) if match else None


def _gemm_dimensions(attributes: str) -> dict | None:
    """The dot dimension numbers of a GPU library matmul (cuBLAS/hipBLAS custom calls keep them
    in their backend config)."""
    match = re.search(r"backend_config=(\{.*\})", attributes)
    if not match:
        return None
    try:
        config = json.loads(match.group(1))
    except ValueError:
        return None
    gemm = config.get("gemm_backend_config") or {}
    return gemm.get("dot_dimension_numbers")


def _dot_flops(lhs: ArrayType, result: ArrayType, contracting: Sequence[int]) -> int:
    return 2 * math.prod(result.shape) * math.prod(lhs.shape[d] for d in contracting)


def _convolution_flops(kernel: ArrayType, result: ArrayType, attributes: str) -> int:
    # Each output element is a dot over the kernel window and the input features of its group:
    # the kernel's size without its output-feature dimension.
    labels = re.search(r"dim_labels=[^_]+_([^-]+)->", attributes)
    out_features = kernel.shape[labels.group(1).index("o")] if labels else 1
    window = math.prod(kernel.shape) // max(out_features, 1)
    return 2 * math.prod(result.shape) * window


def _own_flops(instruction: Instruction, types: dict[str, tuple[ArrayType, ...]]) -> int:
    """torch's `with_flops` counts matmuls and convolutions: 2 * m * n * k."""
    operands = [types.get(name, ()) for name in instruction.operands]
    if not instruction.results or any(not t for t in operands[:2]):
        return 0
    result = instruction.results[0]
    if instruction.opcode == "dot":
        return _dot_flops(operands[0][0], result,
                          _dims(instruction.attributes, "lhs_contracting_dims"))
    if instruction.opcode == "convolution":
        return _convolution_flops(operands[1][0], result, instruction.attributes)
    if instruction.opcode == "custom-call":
        target = (_quoted(instruction.attributes, "custom_call_target") or "").lower()
        if "conv" in target:
            return _convolution_flops(operands[1][0], result, instruction.attributes)
        if "gemm" in target or "matmul" in target:
            numbers = _gemm_dimensions(instruction.attributes) or {}
            contracting = [int(d) for d in numbers.get("lhs_contracting_dimensions", [])]
            return _dot_flops(operands[0][0], result, contracting) if contracting else 0
    return 0


def module_path(op_name: str) -> str:
    """The scope path of an HLO op_name (`jit(step)/jvp(Model)/Dense_0/dot_general`): the
    named scopes between the program and the primitive (`Model/Dense_0`), transformations
    unwrapped and autocast's region markers left out."""
    from jamp.transforms.autocast_rules import MARKER_PREFIX
    parts = op_name.split("/")[1:-1]  # the program (`jit(step)`) and the primitive
    names = []
    for part in parts:
        while re.fullmatch(r"[\w\-]+\(.*\)", part):  # `transpose(jvp(Model))` -> `Model`
            part = part[part.index("(") + 1:-1]
        if part and not part.startswith(MARKER_PREFIX):
            names.append(part)
    return "/".join(names)


class _StackFrames:
    """The source locations of the module's `stack_frame_id`s (newer XLA) or `source_file` /
    `source_line` metadata (older), as `file(line): function` strings, innermost first (the
    form of torch's `FunctionEvent.stack`)."""

    def __init__(self, text: str):
        self.files = self._table(text, "FileNames", r'(\d+)\s+"(.*)"')
        self.functions = self._table(text, "FunctionNames", r'(\d+)\s+"(.*)"')
        self.locations = {int(k): dict(re.findall(r"(\w+)=(\d+)", v)) for k, v in
                          self._table(text, "FileLocations", r"(\d+)\s+\{(.*)\}").items()}
        frames = {int(k): dict(re.findall(r"(\w+)=(\d+)", v)) for k, v in
                  self._table(text, "StackFrames", r"(\d+)\s+\{(.*)\}").items()}
        self.parents = {i: int(f.get("parent_frame_id", 0)) for i, f in frames.items()}
        self.frame_location = {i: int(f.get("file_location_id", 0)) for i, f in frames.items()}
        # Some XLA versions print each parent id one higher than the frame it names (the first
        # frame then names itself); a frame can never be its own parent, so that tells them apart.
        self.offset = 1 if any(p == i for i, p in self.parents.items()) else 0

    @staticmethod
    def _table(text: str, title: str, row: str) -> dict:
        match = re.search(r"^" + title + r"\n((?:.+\n)*)", text, re.M)
        if not match:
            return {}
        return {int(k) if k.isdigit() else k: v
                for k, v in (re.match(row, line).groups() for line in match.group(1).splitlines()
                             if re.match(row, line))}

    def _location(self, frame: int) -> str | None:
        location = self.locations.get(self.frame_location.get(frame, 0))
        if not location:
            return None
        file = self.files.get(int(location.get("file_name_id", 0)), "?")
        function = self.functions.get(int(location.get("function_name_id", 0)), "?")
        return f"{file}({location.get('line', '?')}): {function}"

    def stack(self, attributes: str) -> tuple[str, ...]:
        frame = _number(attributes, "stack_frame_id")
        if frame is None:
            file, line = _quoted(attributes, "source_file"), _number(attributes, "source_line")
            return (f"{file}({line})",) if file else ()
        found, seen = [], set()
        while frame and frame not in seen and frame in self.frame_location:
            seen.add(frame)
            location = self._location(frame)
            if location:
                found.append(location)
            frame = self.parents.get(frame, 0) - self.offset
        return tuple(found)


@dataclasses.dataclass
class Program:
    """A compiled HLO module, parsed: its instructions by name and its memory."""

    name: str
    instructions: dict[str, Instruction]
    temp_bytes: int = 0
    output_bytes: int = 0


def parse_module(text: str, name: str = "") -> Program:
    """Parses the text of a compiled HLO module (`compiled.as_text()`)."""
    frames = _StackFrames(text)
    instructions: dict[str, Instruction] = {}
    computation = ""
    for line in text.splitlines():
        header = _COMPUTATION_RE.match(line)
        if header and not line.startswith(" "):
            computation = header.group("name")
            continue
        match = _INSTRUCTION_RE.match(line)
        if not match or not line.startswith(" "):
            continue
        shape, after = _split_shape(match.group("rest"))
        opcode, paren, tail = after.partition("(")
        if not paren:
            continue
        close = _matching_paren("(" + tail, 0)
        operands_text, attributes = tail[:close - 1], tail[close:]
        instruction = Instruction(
            name=match.group("name").lstrip("%"), opcode=opcode.strip(),
            results=parse_types(shape), operands=tuple(_OPERAND_RE.findall(operands_text)),
            attributes=attributes, computation=computation)
        op_name = _quoted(attributes, "op_name") or ""
        instruction.scope = module_path(op_name)
        instruction.stack = frames.stack(attributes)
        instructions[instruction.name] = instruction
    types = {i.name: i.results for i in instructions.values()}
    by_computation: dict[str, list[Instruction]] = {}
    for instruction in instructions.values():
        instruction.operand_types = tuple(t for n in instruction.operands for t in types.get(n, ()))
        instruction.flops = _own_flops(instruction, types)
        by_computation.setdefault(instruction.computation, []).append(instruction)
    # A fusion (or a call XLA runs as one thunk) does the FLOPs of the computation it calls.
    for instruction in instructions.values():
        if instruction.opcode in ("fusion", "call") and not instruction.flops:
            instruction.flops = _called_flops(instruction, by_computation, set())
    return Program(name=name, instructions=instructions)


def _called_flops(instruction: Instruction, by_computation: dict, seen: set) -> int:
    total = 0
    for callee in re.findall(r"(?:calls|to_apply)=%?([^\s,}]+)", instruction.attributes):
        if callee in seen:
            continue
        seen.add(callee)
        for inner in by_computation.get(callee, ()):
            total += inner.flops or (_called_flops(inner, by_computation, seen)
                                     if inner.opcode in ("fusion", "call") else 0)
    return total


def _module_id(module) -> int:
    """The HloModuleProto `id` (field 5): the `program_id` a trace's events carry."""
    data = module.as_serialized_hlo_module_proto()
    i = 0
    while i < len(data):
        key, i = _varint(data, i)
        field, wire = key >> 3, key & 7
        if wire == 0:
            value, i = _varint(data, i)
            if field == 5:
                return value
        elif wire == 2:
            size, i = _varint(data, i)
            i += size
        elif wire == 1:
            i += 8
        elif wire == 5:
            i += 4
        else:
            break
    return 0


def _varint(data: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[i]
        i += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if byte < 0x80:
            return value, i


class ProgramCatalog:
    """The compiled programs a trace ran, found among the live executables by module name and
    program id, parsed once each."""

    def __init__(self, wanted: Iterable[tuple[str, int]]):
        wanted = set(wanted)
        self._programs: dict[tuple[str, int], Program] = {}
        if not wanted:
            return
        names = {name for name, _ in wanted}
        for executable in jx.live_executables():
            try:
                modules = executable.hlo_modules()
            except Exception:  # an executable that no longer has its HLO
                continue
            for module in modules:
                if module.name not in names:
                    continue
                key = (module.name, _module_id(module))
                if key in wanted and key not in self._programs:
                    program = parse_module(module.to_string(), module.name)
                    stats = _memory_stats(executable)
                    program.temp_bytes, program.output_bytes = stats
                    self._programs[key] = program

    def program(self, name: str, program_id: int) -> Program | None:
        return self._programs.get((name, program_id))

    def instruction(self, name: str, program_id: int, op: str) -> Instruction | None:
        program = self.program(name, program_id)
        return program.instructions.get(op) if program else None


def _memory_stats(executable) -> tuple[int, int]:
    try:
        stats = executable.get_compiled_memory_stats()
    except Exception:  # a backend without memory statistics
        return 0, 0
    return int(getattr(stats, "temp_size_in_bytes", 0)), int(
        getattr(stats, "output_size_in_bytes", 0))


def numpy_dtype(name: str):
    """The numpy dtype of an HLO dtype name (ml_dtypes' for bfloat16 and float8)."""
    import jax.numpy as jnp
    return np.dtype(getattr(jnp, name))
