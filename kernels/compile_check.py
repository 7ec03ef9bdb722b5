"""Compile every kernel for a CUDA target without a GPU, as the engine launches it: catches Triton compiler failures on
machines (CI) that can only interpret the kernels.

    python -m kernels.compile_check                    # every launch of engine_launches(), for sm_90, installed Triton
    python -m kernels.compile_check --capability 103   # the same for sm_103 (B300); 100: B200
    python -m kernels.compile_check --usage            # also each compile's registers and spills (ptxas -v)
    python -m kernels.compile_check --sass --only gdn_chunk   # SASS instructions and opcodes of the gdn_chunk launches
    python -m kernels.compile_check --only gdn_chunk --listings /tmp/sass   # and their SASS listings, one file each
    python -m kernels.compile_check --gates            # the rounded gates' exact path against Triton's own PTX of it

The installed Triton compiles (the lab's venv: 3.9); the H200 image runs 3.6, whose code differs (gdn_chunk's walk
spills 344 bytes there against 224). To see the device's code, put that Triton first on the path, e.g.
`pip install --no-deps --target /tmp/triton36 triton==3.6.0`, then `PYTHONPATH=/tmp/triton36 python -m
kernels.compile_check ...` (every kernel compiles under both, checked at 69f2ce4).

How. Each public wrapper (`kernels.silu_mul`, `gdn_prep`, ...) is called on meta tensors (shapes and dtypes, no memory)
at the 27B widths with the kernels in GPU mode; the launch is captured instead of run, so the grid-independent part of
it (argument types, constexprs, num_warps, fp options) is exactly what the wrapper would launch on a GPU. The captured
launch is then compiled by `triton.compile` for one target (sm_90 by default; `CAPABILITIES` lists the targets the tests
check: the H200's sm_90, Blackwell's sm_100 and sm_103), down to a cubin with Triton's bundled ptxas, twice: with every
pointer and every integer that is a multiple of 16 specialised as 16-divisible (what aligned tensors give) and with none
(unaligned views, odd strides). Integers equal to 1 are specialised to constants, as Triton's launcher does. Nothing
runs. Blackwell gets the stages' launches only; sm_90 also the ones that only the GPU tests and the probes make on the
lab's Hopper cards (`reference_only`: the reference ways of gdn_prep, the probe's walks), which took 132 of the 208 s of
CPU that sm_103's compiles took from an empty cache on the dev machine (2026-12-07). `--gates` compiles
`numerics.silu_f32` and `sigmoid_f32` (torch's formulas) alone and compares the PTX of each with the exact path of
`SILU_BF16_PTX` / `SIGMOID_BF16_PTX`, instruction by instruction after naming every register by the value it holds and
putting each constant in place of its register: the inline assembly's exact path is then the code Triton compiles
torch's formula to, whose bits the GPU tests have checked against torch. `--usage` prints each compile's registers,
spill stores and spill loads as the target's ptxas -v reports them (aligned only).

Why. The interpreter runs the kernels' Python, never Triton's MLIR passes, so a kernel can pass every CPU test and still
fail to compile on the GPU (gdn_prep v2 under Triton 3.6: engine/stages/fused.md, "Kernel history"); a failure that
only one Triton version shows needs that version. Must run without TRITON_INTERPRET (the kernels must be
JITFunctions): tests run it in a subprocess (tests/test_kernels.py).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import itertools
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from kernels import numerics

SM90 = 90
CAPABILITIES = (SM90, 100, 103)  # H200 (Hopper); B200 and B300 (Blackwell: B300, sm_103, is the design target)
META = torch.device("meta")
# gdn_prep over cu_seqlens (its binary search: 0, 1, 4-7 and 12 steps; 4-7 are where v2 failed under Triton 3.6,
# engine/stages/fused.md), with a row index and at output slots: the GPU tests' and the prep probe's references (the
# engine launches only the taps way). The depth only sets an unrolled loop's length.
SEQUENCE_COUNTS = (1, 2, 9, 17, 33, 65, 4097)
SLOTS_SEQUENCE_COUNTS = (17,)  # gdn_prep's output slots (the tree's packed rows): 5 search steps
SASS_OPCODES_SHOWN = 8  # `--sass`: the most common opcodes listed per kernel
SPLITS = (1, 2, 3, 4)  # residual_rmsnorm_splitk: the split-K GEMM's S (a constexpr: one kernel each)
OPTION_NAMES = ("num_warps", "num_stages", "num_ctas", "maxnreg", "enable_fp_fusion", "enable_reflect_ftz")
DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int16: "i16", torch.int32: "i32",
          torch.int64: "i64"}  # fmt: skip


@dataclass
class Launch:
    """One captured kernel launch: the JITFunction, its bound arguments by name and its launch options."""

    kernel: Any
    arguments: dict[str, Any]
    options: dict[str, Any]


@contextlib.contextmanager
def captured_launches() -> Iterator[list[Launch]]:
    """Within: the wrappers see GPU mode (`kernel_mode` False) and every `kernel[grid](...)` is recorded, not run."""
    import importlib

    # the modules, not the same-named functions that `kernels` re-exports
    families = ("activations", "attn_prep", "gdn_chunk", "gdn_prep", "norms")
    modules = [importlib.import_module(f"kernels.{name}") for name in families]
    launches: list[Launch] = []

    def capture(self, *args, grid=None, warmup=False, **kwargs):
        options = {name: kwargs.pop(name) for name in OPTION_NAMES if name in kwargs}
        arguments = dict(zip(self.arg_names, args)) | kwargs
        launches.append(Launch(self, arguments, options))

    saved_run = triton.runtime.JITFunction.run
    saved_modes = [module.kernel_mode for module in modules]
    triton.runtime.JITFunction.run = capture
    for module in modules:
        module.kernel_mode = lambda kernel, device: False
    try:
        yield launches
    finally:
        triton.runtime.JITFunction.run = saved_run
        for module, mode in zip(modules, saved_modes):
            module.kernel_mode = mode


def _meta(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device=META)


def engine_launches(capability: int = SM90) -> list[tuple[str, Callable[[], Any]]]:
    """(label, call) of each kernel configuration the engine launches at the 27B shapes (odd row counts), and on
    sm_90 also the configurations that only the GPU tests and the probes launch (`reference_only`): those run on the
    lab's Hopper cards, never in a stage on Blackwell."""
    import kernels
    from kernels.gdn_chunk import gdn_chunk_forward
    from reference.shapes import QWEN38_27B as s

    rows, keys = 337, 1300
    hv, dv = s.linear_num_value_heads, s.linear_value_head_dim
    gdn = {
        "num_k_heads": s.linear_num_key_heads,
        "num_v_heads": hv,
        "head_k_dim": s.linear_key_head_dim,
        "head_v_dim": dv,
    }
    attn = {"num_heads": s.num_attention_heads, "num_kv_heads": s.num_key_value_heads, "head_dim": s.head_dim}
    gdn_proj, attn_proj = _meta(rows, s.gdn_in_width), _meta(rows, s.attn_in_width)
    z = gdn_proj[:, s.conv_dim : s.conv_dim + s.linear_value_dim]
    hidden, weight = _meta(rows, s.hidden_size), _meta(s.hidden_size)
    cos_sin = (_meta(rows, s.rotary_dim), _meta(rows, s.rotary_dim))
    head_weights = (_meta(s.head_dim), _meta(s.head_dim))
    gdn_weights = (_meta(s.conv_dim, s.linear_conv_kernel_dim), _meta(hv, dtype=torch.float32), _meta(hv))
    o, o_rows, key_rows = _meta(rows, hv, dv), _meta(rows, dtype=torch.int64), _meta(keys, dtype=torch.int64)
    eps = s.rms_norm_eps
    launches = [
        ("silu_mul", lambda: kernels.silu_mul(_meta(rows, 2 * s.intermediate_size))),
        ("residual_rmsnorm", lambda: kernels.residual_rmsnorm(hidden, hidden, weight, eps)),
        ("rmsnorm_1p", lambda: kernels.rmsnorm_1p(hidden, weight, eps)),
        *(
            (
                f"residual_rmsnorm_splitk S={splits}",
                lambda splits=splits: kernels.residual_rmsnorm_splitk(
                    hidden, _meta(splits, rows, s.hidden_size, dtype=torch.float32), weight, eps
                ),
            )
            for splits in SPLITS
        ),
        ("gated_rmsnorm fp32 w", lambda: kernels.gated_rmsnorm(o, z, _meta(dv, dtype=torch.float32), eps)),
        ("gated_rmsnorm bf16 w", lambda: kernels.gated_rmsnorm(o, z, _meta(dv), eps)),
        ("gated_rmsnorm o_rows", lambda: kernels.gated_rmsnorm(o, z, _meta(dv), eps, o_rows=o_rows)),
        ("attn_prep thd", lambda: kernels.attn_prep(attn_proj, *head_weights, *cos_sin, eps, **attn)),
        ("attn_prep htd", lambda: kernels.attn_prep(attn_proj, *head_weights, *cos_sin, eps, layout="htd", **attn)),
        (
            "attn_prep key_rows",
            lambda: kernels.attn_prep(attn_proj, *head_weights, *cos_sin, eps, key_rows=key_rows, **attn),
        ),
        (
            "attention_gate",
            lambda: kernels.attention_gate(
                _meta(rows, s.num_attention_heads, s.head_dim),
                kernels.attention_gate_view(attn_proj, num_heads=s.num_attention_heads, head_dim=s.head_dim),
            ),
        ),
    ]
    chunk_qk, chunk_v = _meta(rows, s.linear_num_key_heads, s.linear_key_head_dim), _meta(rows, hv, dv)
    chunk_gates = (_meta(rows, hv, dtype=torch.float32), _meta(rows, hv))
    # drone's bucket (replicated) with its tree walk on the packed rows (the stage's) and on gathered inputs, without
    # the walk; a hand-off call; the fla-blocks solve (the stage's before blocks-doubling); the probe's value blocks of
    # 32 (`measure.gdn_chunk_probe`), with a 168-register cap, and of 16
    bv32, bv16 = ({"value_block": bv, "unverified_value_block": True} for bv in (32, 16))
    tiles = {"walk rows bv32": bv32, "walk rows bv32 r168": bv32 | {"max_registers": 168}, "walk rows bv16": bv16,
             "walk rows fla-blocks": {"solve": "fla-blocks"}}  # fmt: skip
    modes = ("walk rows", "walk", "replicated", "handoff", "walk rows fla-blocks", "walk rows bv32",
             "walk rows bv32 r168", "walk rows bv16")  # fmt: skip
    for sequences, mode in ((5 if mode == "handoff" else 18, mode) for mode in modes):
        states = _meta(sequences, hv, s.linear_key_head_dim, dv, dtype=torch.float32) if mode == "handoff" else None
        walk = _meta(sequences, 8, dtype=torch.int64) if mode.startswith("walk") else None
        slot_rows = _meta(keys, dtype=torch.int64) if mode.startswith("walk rows") else None

        def chunk_call(sequences=sequences, states=states, walk=walk, slot_rows=slot_rows, mode=mode):
            cu_seqlens, chunk_indices = _meta(sequences + 1, dtype=torch.int64), _meta(26, 2, dtype=torch.int64)
            return gdn_chunk_forward(
                chunk_qk, chunk_qk, chunk_v, *chunk_gates, cu_seqlens, initial_state=states,
                output_final_state=mode == "handoff", chunk_indices=chunk_indices, walk=walk, rows=slot_rows,
                **tiles.get(mode, {}),
            )  # fmt: skip

        launches.append((f"gdn_chunk {sequences} seqs {mode}", chunk_call))
    for sequences in SEQUENCE_COUNTS:
        cu_seqlens = _meta(sequences + 1, dtype=torch.int32)
        ways = ((False, False), (True, False)) + (((True, True),) if sequences in SLOTS_SEQUENCE_COUNTS else ())
        for with_rows, with_slots in ways:
            for l2norm in (True, False) if sequences == 1 and not with_rows else (True,):
                label = (f"gdn_prep {sequences} seqs{' rows' if with_rows else ''}{' slots' if with_slots else ''}"
                         f"{'' if l2norm else ' no-l2norm'}")  # fmt: skip
                index = _meta(keys, dtype=torch.int64) if with_rows else None
                slots = _meta(rows, dtype=torch.int64) if with_slots else None

                def call(cu_seqlens=cu_seqlens, index=index, slots=slots, l2norm=l2norm):
                    return kernels.gdn_prep(
                        gdn_proj, *gdn_weights, cu_seqlens, rows=index, slots=slots, qk_l2norm=l2norm, **gdn
                    )

                launches.append((label, call))
    taps = _meta(rows, s.linear_conv_kernel_dim, dtype=torch.int64)  # a plan's conv_taps: the engine's gdn_prep
    launches.append(("gdn_prep taps", lambda: kernels.gdn_prep(gdn_proj, *gdn_weights, None, taps=taps, **gdn)))
    prepared = (chunk_qk[None], chunk_qk[None], chunk_v[None], chunk_gates[0][None], chunk_gates[1][None])
    launches.append(("gather_slots", lambda: kernels.gather_slots(prepared, _meta(keys, dtype=torch.int64))))
    count = _meta(1, dtype=torch.int64)  # the hand-off arena's (stage flashinfer_gdn)
    launches.append(
        (
            "gather_slots count linear",
            lambda: kernels.gather_slots(prepared, _meta(keys, dtype=torch.int64), count=count, linear_gates=True),
        )
    )
    return [(label, call) for label, call in launches if capability == SM90 or not reference_only(label)]


def reference_only(label: str) -> bool:
    """A launch no stage makes: gdn_prep over cu_seqlens, with a row index or at output slots (the engine's is
    `gdn_prep taps`), and gdn_chunk on gathered inputs or at the probe's solves and value blocks (the stages' are
    `walk rows`, `replicated` and `handoff`)."""
    if label.startswith("gdn_prep"):
        return label != "gdn_prep taps"
    return label.startswith("gdn_chunk") and label.split(" seqs ")[1] not in ("walk rows", "replicated", "handoff")


def compile_launch(launch: Launch, *, aligned: bool, capability: int = SM90):
    """Compile one captured launch for `capability` (Triton's own specialisation rules: pointers and integers that
    are multiples of 16 marked divisible when `aligned`, integers equal to 1 made constants); raises on failure."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel = launch.kernel
    signature, constants, attributes = {}, {}, {}
    for index, param in enumerate(kernel.params):
        value = launch.arguments[param.name]
        if param.is_constexpr:
            signature[param.name], constants[param.name] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            signature[param.name] = "*" + DTYPES[value.dtype]
            if aligned:
                attributes[(index,)] = [["tt.divisibility", 16]]
        elif isinstance(value, bool):
            signature[param.name] = "i1"
        elif isinstance(value, int):
            if value == 1 and not param.do_not_specialize:
                signature[param.name], constants[param.name] = "constexpr", 1
                continue
            signature[param.name] = "i32" if -(2**31) <= value < 2**31 else "i64"
            if aligned and value % 16 == 0:
                attributes[(index,)] = [["tt.divisibility", 16]]
        elif isinstance(value, float):
            signature[param.name] = "fp32"
        else:
            raise TypeError(f"compile_check: {kernel.__name__}.{param.name} = {value!r} has no Triton type here")
    source = ASTSource(kernel, signature, constants, attributes)
    return triton.compile(source, target=GPUTarget("cuda", capability, 32), options=launch.options)


def ptxas_usage(compiled, capability: int = SM90) -> str:
    """Registers, spill stores and spill loads of a compiled kernel, from the target's ptxas -v on its PTX (the
    ptxas Triton bundles, sm_<capability>a)."""
    import tempfile

    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.ptx")
        with open(path, "w") as ptx:
            ptx.write(compiled.asm["ptx"])
        arch = sm_arch_from_capability(capability)
        command = [get_ptxas(capability).path, "-v", f"--gpu-name={arch}", path, "-o", os.path.join(tmp, "k.cubin")]
        report = subprocess.run(command, capture_output=True, text=True, timeout=600).stderr
    spills = next((line.strip() for line in report.splitlines() if "spill stores" in line), "?")
    registers = next((line.split("Used")[-1].strip() for line in report.splitlines() if "Used" in line), "?")
    return f"{registers}; {spills}"


def sass_opcodes(compiled) -> collections.Counter:
    """How many SASS instructions of each opcode (modifiers dropped: `FADD.FTZ` is FADD) a compiled kernel has,
    from cuobjdump's listing of its cubin (`triton.tools.disasm`, Triton's bundled cuobjdump): static counts, each
    loop body once."""
    from triton.tools.disasm import get_sass

    opcodes = collections.Counter()
    for line in get_sass(compiled.asm["cubin"]).splitlines():
        words = line.split("\t", 1)[1].split() if "\t" in line else []
        words = words[1:] if words and words[0].startswith("@") else words  # a predicate
        if words:
            opcodes[words[0].rstrip(";").split(".")[0]] += 1
    return opcodes


def check(
    capability: int = SM90,
    *,
    usage: bool = False,
    sass: bool = False,
    only: str | None = None,
    listings: str | None = None,
) -> list[tuple[str, str, bool, str | None, str | None]]:
    """(label, kernel name, aligned, None or the compiler's last error line, None or the notes) for every launch of
    `engine_launches`; the notes of each aligned compile: with `usage` its registers and spills (`ptxas_usage`), with
    `sass` its SASS instruction count and most common opcodes (`sass_opcodes`); `only`: the launches whose label
    starts with it; `listings`: a folder that gets each aligned compile's SASS listing (<label>.<kernel>.sass)."""
    from triton.tools.disasm import get_sass

    from kernels import activations

    if not isinstance(activations._silu_mul_kernel, triton.runtime.JITFunction):
        raise RuntimeError("compile_check: the kernels were defined under TRITON_INTERPRET=1; run without it")
    results = []
    for label, call in engine_launches(capability):
        if only is not None and not label.startswith(only):
            continue
        with captured_launches() as launches:
            call()
        if not launches:
            raise RuntimeError(f"compile_check: {label} launched no kernel")
        for launch, aligned in itertools.product(launches, (True, False)):
            note = None
            try:
                compiled = compile_launch(launch, aligned=aligned, capability=capability)
                error = None
            except Exception as failure:  # CompilationError, RuntimeError from the pass manager: report either
                error = (str(failure).strip().splitlines() or [repr(failure)])[-1]
            if error is None and aligned:
                notes = [ptxas_usage(compiled, capability)] if usage else []
                if listings is not None:
                    os.makedirs(listings, exist_ok=True)
                    listing = os.path.join(listings, f"{label.replace(' ', '_')}.{launch.kernel.__name__}.sass")
                    with open(listing, "w") as out:
                        out.write(get_sass(compiled.asm["cubin"]))
                if sass:
                    opcodes = sass_opcodes(compiled)
                    common = ", ".join(f"{op} {n}" for op, n in opcodes.most_common(SASS_OPCODES_SHOWN))
                    notes.append(f"{sum(opcodes.values())} SASS instructions: {common}")
                note = "; ".join(notes) or None
            results.append((label, launch.kernel.__name__, aligned, error, note))
    return results


@triton.jit
def _silu_reference_kernel(x_ptr, y_ptr):
    """torch's silu formula (`numerics.silu_f32`) on 32 values, one a thread: its PTX is `--gates`' reference."""
    offsets = tl.arange(0, 32)
    tl.store(y_ptr + offsets, numerics.silu_f32(tl.load(x_ptr + offsets), False))


@triton.jit
def _sigmoid_reference_kernel(x_ptr, y_ptr):
    """torch's sigmoid formula (`numerics.sigmoid_f32`) on 32 values, one a thread: `--gates`' reference."""
    offsets = tl.arange(0, 32)
    tl.store(y_ptr + offsets, numerics.sigmoid_f32(tl.load(x_ptr + offsets), False))


def _instruction(line: str) -> tuple[str, list[str]]:
    """One PTX instruction line as (opcode, operands): `fma.rn.f32 %r8, %r5, %r7, %r6;` -> ("fma.rn.f32", [...])."""
    opcode, _, operands = line.strip().rstrip(";").partition(" ")
    return opcode, [operand.strip() for operand in operands.split(",")]


def _ptx_values(lines: list[str], x: str, constants: dict[str, str]) -> list[tuple[str, tuple[str, ...]]]:
    """PTX instructions as (opcode, sources): each register named by the instruction that wrote it (v0, v1, ...),
    `x` named x, registers that hold a `mov.b32` constant replaced by it (those movs dropped)."""
    constants, names, values = dict(constants), {x: "x"}, []
    for line in lines:
        opcode, registers = _instruction(line)
        if opcode == "mov.b32" and registers[1].startswith("0f"):
            constants[registers[0]] = registers[1]
            continue
        sources = tuple(constants.get(r) or names.get(r) or r for r in registers[1:])
        names[registers[0]] = f"v{len(values)}"
        values.append((opcode, sources))
    return values


def _as_negation(line: str, constants: dict[str, str]) -> str:
    """A negation of an fp32 value as `neg.f32 r, x;`, however LLVM wrote it: `xor.b32 r, x, -2147483648;` (the sign
    bit flipped: Triton 3.9) or `sub.rn.f32 r, zero, x;` (0 − x: Triton 3.6). Each gives −x's bits but for NaN
    payloads and, for 0 − x, the sign of a zero, which exp(−x) does not see."""
    opcode, registers = _instruction(line)
    if opcode == "xor.b32" and registers[-1] == "-2147483648":
        return f"neg.f32 {registers[0]}, {registers[1]};"
    if opcode == "sub.rn.f32" and constants.get(registers[1], registers[1]) == "0f00000000":
        return f"neg.f32 {registers[0]}, {registers[2]};"
    return line


def gate_exact_paths(capability: int = SM90) -> list[str]:
    """Where the exact path of `numerics.SILU_BF16_PTX` / `SIGMOID_BF16_PTX` differs from the PTX that Triton
    compiles `silu_f32` / `sigmoid_f32` to (from the negation of x to the IEEE division, `_as_negation`): empty when
    both equal."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    problems = []
    cases = (("silu", _silu_reference_kernel, numerics.SILU_BF16_PTX), ("sigmoid", _sigmoid_reference_kernel,
             numerics.SIGMOID_BF16_PTX))  # fmt: skip
    for name, kernel, assembly in cases:
        source = ASTSource(kernel, {"x_ptr": "*fp32", "y_ptr": "*fp32"}, {}, {})
        options = dict(numerics.LAUNCH_OPTIONS, num_warps=1)
        ptx = triton.compile(source, target=GPUTarget("cuda", capability, 32), options=options).asm["ptx"]
        lines = [line.split("//")[0].strip() for line in ptx.splitlines()]
        lines = [line for line in lines if line and not line.startswith((".", "$", "{", "}"))]
        constants = {registers[0]: registers[1] for opcode, registers in map(_instruction, lines)
                     if opcode == "mov.b32" and registers[1].startswith("0f")}  # fmt: skip
        lines = [_as_negation(line, constants) for line in lines]
        start = next(i for i, line in enumerate(lines) if line.startswith("neg.f32"))
        end = next(i for i, line in enumerate(lines) if line.startswith("div.rn.f32"))
        x = lines[start].rstrip(";").split(",")[1].strip()
        want = _ptx_values(lines[start : end + 1], x, constants)
        ours = [line.strip() for line in assembly.value.splitlines()]
        ours = ours[ours.index("neg.f32 n, $1;") : next(i for i, line in enumerate(ours) if "div.rn.f32" in line) + 1]
        got = _ptx_values(ours, "$1", {})
        if got != want:
            problems.append(f"{name}: the exact path {got} is not Triton's {want}")
    return problems


def ptxas_lacks(capability: int) -> str | None:
    """None where the ptxas that Triton uses for `capability` lists its arch (`sm_<capability>a`) among the GPU names
    it can target (`ptxas --help`); otherwise why the check cannot run for it."""
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    ptxas, arch = get_ptxas(capability).path, sm_arch_from_capability(capability)
    listed = subprocess.run([ptxas, "--help"], capture_output=True, text=True, timeout=60).stdout
    if f"'{arch}'" in listed:
        return None
    version = subprocess.run([ptxas, "--version"], capture_output=True, text=True, timeout=60).stdout.strip()
    return f"{ptxas} ({version.splitlines()[-1] if version else 'no version'}) cannot target {arch}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kernels.compile_check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--capability", type=int, default=SM90, help="CUDA compute capability, e.g. 90, 100, 103")
    parser.add_argument("--usage", action="store_true", help="registers and spills per aligned compile (ptxas -v)")
    parser.add_argument("--sass", action="store_true", help="SASS instructions and opcodes per aligned compile")
    parser.add_argument("--only", default=None, help="only the launches whose label starts with this")
    parser.add_argument("--listings", default=None, help="a folder for each aligned compile's SASS listing")
    parser.add_argument("--gates", action="store_true", help="only: the gates' exact path against Triton's PTX")
    args = parser.parse_args(argv)
    capability = args.capability
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("compile_check: unset TRITON_INTERPRET (the kernels must be compiled, not interpreted)", file=sys.stderr)
        return 2
    lacking = ptxas_lacks(capability)
    if lacking:
        print(f"compile_check: {lacking}", file=sys.stderr)
        return 2
    if args.gates:
        problems = gate_exact_paths(capability)
        print("\n".join(problems) or "silu_bf16 and sigmoid_bf16: the exact path is Triton's PTX of torch's formula")
        return 1 if problems else 0
    results = check(capability, usage=args.usage, sass=args.sass, only=args.only, listings=args.listings)
    print(f"kernels for sm_{capability}, Triton {triton.__version__}: {len(results)} compiles")
    for label, name, aligned, error, note in results:
        line = f"  {label:<34} {name:<26} {'aligned' if aligned else 'unaligned':<9} {error or 'ok'}"
        print(line if note is None else f"{line}  [{note}]")
    failed = sum(error is not None for *_, error, _ in results)
    print(f"{len(results) - failed} compiled, {failed} failed")
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
