"""What the profiler needs to know about a compiled program, read from its HLO text.

A JAX trace names what ran only by HLO module, program id and HLO instruction (`ynn_fusion.1`,
`dot.3`, a GPU kernel's `fusion.12`). The compiled program says the rest: each instruction's
result and operand shapes and dtypes, the matmul and convolution FLOPs inside it, the
`jax.named_scope` path it came from (Flax linen module paths) and the user's source line.

`ProgramCatalog` finds the live compiled programs (`jamp._jax_internals`), parses the
ones a trace mentions, and answers by (module name, program id, instruction name).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from typing import Iterable, Sequence


from jamp.transforms.rules import module_path
from jamp import _jax_internals as jx

# HLO element types by their text names; `pred` is a bool, the rest are numeric.
_DTYPE_NAMES = {
    "pred": "bool", "s4": "int4", "s8": "int8", "s16": "int16", "s32": "int32", "s64": "int64",
    "u4": "uint4", "u8": "uint8", "u16": "uint16", "u32": "uint32", "u64": "uint64",
    "f16": "float16", "bf16": "bfloat16", "f32": "float32", "f64": "float64",
    "c64": "complex64", "c128": "complex128", "f8e4m3fn": "float8_e4m3fn",
    "f8e5m2": "float8_e5m2", "f8e4m3fnuz": "float8_e4m3fnuz", "f8e5m2fnuz": "float8_e5m2fnuz",
    "f8e4m3b11fnuz": "float8_e4m3b11fnuz", "f8e4m3": "float8_e4m3", "f8e3m4": "float8_e3m4",
    "f8e8m0fnu": "float8_e8m0fnu", "f4e2m1fn": "float4_e2m1fn", "s2": "int2", "u2": "uint2",
}
_BITS = {"bool": 8, "int2": 2, "uint2": 2, "int4": 4, "uint4": 4, "int8": 8, "uint8": 8,
         "int16": 16, "uint16": 16, "int32": 32, "uint32": 32, "int64": 64, "uint64": 64,
         "float16": 16, "bfloat16": 16, "float32": 32, "float64": 64, "complex64": 64,
         "complex128": 128, "float4_e2m1fn": 4,
         **{name: 8 for name in _DTYPE_NAMES.values() if name.startswith("float8")}}

# An array type: `f32[16,128]`; a dynamic dimension prints with its bound (`<=16`), an
# unbounded one as `?`.
_ARRAY_RE = re.compile(r"([a-z][a-z0-9]*)\[([0-9,<=?]*)\]")
_INSTRUCTION_RE = re.compile(r"^\s*(?:ROOT\s+)?%?(?P<name>[^\s=]+)\s*=\s*(?P<rest>.*)$")
_COMPUTATION_RE = re.compile(r"^(?:ENTRY\s+)?%?(?P<name>[^\s(]+)\s*\(.*\{\s*$")
_DIMS_RE = r"{key}=\{{([0-9,]*)\}}"


@dataclasses.dataclass(frozen=True)
class ArrayType:
    """One array in an HLO shape: its dtype name (numpy's spelling) and dimensions (a dynamic
    dimension at its bound, an unbounded one -1)."""

    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        if any(d < 0 for d in self.shape):
            return 0  # unbounded: not known before it runs
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
    scope: str = ""  # every named scope of the op (`step/Model/Dense_0`)
    module_hierarchy: str = ""  # the module scopes among them (`Model/Dense_0`)
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
        found.append(ArrayType(dtype, tuple(-1 if d == "?" else int(d.lstrip("<="))
                                            for d in dims.split(",") if d)))
    return tuple(found)


def _split_top_level(text: str) -> list[str]:
    """`text` split at the commas outside brackets: `f32[2,3]{1,0} %a, %b` -> two operands."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(text):
        if char in "([{":
            depth += 1
        elif char in ")]}":
            depth -= 1
        elif char == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [part.strip() for part in parts if part.strip()]


def _operand_names(text: str) -> tuple[str, ...]:
    """The instruction names among an operand list. XLA prints an operand as `%name`, `name`
    or with its type first (`f32[2]{0} %name`), long lists with `/*index=5*/` comments; the
    name is the last word either way."""
    text = re.sub(r"/\*.*?\*/", " ", text)
    return tuple(part.split()[-1].lstrip("%") for part in _split_top_level(text))


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


def _backend_config(attributes: str) -> dict:
    """An instruction's backend config: JSON printed bare (`backend_config={...}`), or as a
    quoted string by older XLA; other attributes may follow it."""
    quoted = _quoted(attributes, "backend_config")
    text = quoted.encode().decode("unicode_escape") if quoted is not None else None
    if text is None:
        start = attributes.find("backend_config={")
        text = attributes[start + len("backend_config="):] if start >= 0 else ""
    try:
        config, _ = json.JSONDecoder().raw_decode(text)
    except ValueError:
        return {}
    return config if isinstance(config, dict) else {}


def _gemm_dimensions(attributes: str) -> dict | None:
    """The dot dimension numbers of a GPU library matmul (cuBLAS/hipBLAS custom calls keep them
    in their backend config)."""
    gemm = _backend_config(attributes).get("gemm_backend_config") or {}
    return gemm.get("dot_dimension_numbers")


def _dot_flops(lhs: ArrayType, result: ArrayType, contracting: Sequence[int]) -> int:
    if any(d < 0 for d in lhs.shape + result.shape) or any(d >= len(lhs.shape)
                                                            for d in contracting):
        return 0  # an unbounded dimension, or dimension numbers we misread: not counted
    return 2 * math.prod(result.shape) * math.prod(lhs.shape[d] for d in contracting)


def _convolution_flops(kernel: ArrayType, result: ArrayType, attributes: str) -> int:
    # Each output element is a dot over the kernel window and the input features of its group:
    # the kernel's size without its output-feature dimension.
    if any(d < 0 for d in kernel.shape + result.shape):
        return 0
    labels = re.search(r"dim_labels=[^_]+_([^-]+)->", attributes)
    out = labels.group(1).find("o") if labels else -1
    out_features = kernel.shape[out] if 0 <= out < len(kernel.shape) else 1
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


# What JAX writes into an op's name besides the user's named scopes
# (`jit(step)/transpose(jvp(Model))/while/body/closed_call/Dense_0/dot_general`): the program
# and nested jitted calls (`jit(f)`), the transformations wrapped around a scope
# (`jvp(Model)`), the primitives whose body XLA inlined (`closed_call` by the running jax's
# name, `checkpoint`, `shard_map`) and the regions of control flow (`while/body`,
# `cond/branch_1_fun`): names from JAX's lowering rules (pjit, lax.control_flow,
# ad_checkpoint, shard_map).
_CALL = re.compile(r"(?:jit|pjit|pmap|xla_pmap)\(.*\)")
_TRANSFORM = re.compile(r"(?:jvp|transpose|vmap)\((.*)\)")
_INLINED = frozenset({jx.CLOSED_CALL, "checkpoint", "rematted_computation", "shard_map"})
_REGIONS = {"while": re.compile(r"body|cond|body_pred"), "cond": re.compile(r"branch_\d+_fun")}


def scope_names(op_name: str) -> tuple[str, ...]:
    """The named scopes in an HLO op_name, outermost first: the user's `jax.named_scope`s,
    Flax linen's module scopes, the labels of `record_function`; JAX's own names left out."""
    # XLA joins the op_names of instructions it merged with ";": the first is the op's own.
    parts = op_name.split(";", 1)[0].split("/")[:-1]  # the last is the primitive
    names = []
    i = 0
    while i < len(parts):
        part = parts[i]
        while match := _TRANSFORM.fullmatch(part):  # `transpose(jvp(Model))` -> `Model`
            part = match.group(1)
        region = _REGIONS.get(part)
        if region is not None and i + 1 < len(parts) and region.fullmatch(parts[i + 1]):
            i += 2
            continue
        if part and part not in _INLINED and not _CALL.fullmatch(part):
            names.append(part)
        i += 1
    return tuple(names)


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
        rows = (re.match(row, line) for line in match.group(1).splitlines())
        return {int(k) if k.isdigit() else k: v for k, v in (m.groups() for m in rows if m)}

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
            results=parse_types(shape), operands=_operand_names(operands_text),
            attributes=attributes, computation=computation)
        names = scope_names(_quoted(attributes, "op_name") or "")
        instruction.scope = "/".join(names)
        instruction.module_hierarchy = "/".join(module_path((), names))
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


__all__ = [
    "ArrayType", "Instruction", "parse_module", "parse_types", "Program", "ProgramCatalog",
    "scope_names"
]
