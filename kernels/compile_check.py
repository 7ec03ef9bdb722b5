"""Compile kernels for a CUDA target without a GPU: catches Triton compiler failures on machines (CI) that can only
interpret the kernels.

    python -m kernels.compile_check            # gdn_prep at every specialisation the engine can launch, for sm_90

The interpreter runs the kernels' Python, never Triton's MLIR passes, so a kernel can pass every CPU test and still fail
to compile on the GPU. That happened to gdn_prep v2 under Triton 3.6 (the H200's): with a row index and 9 to 32 packed
sequences (SEARCH_STEPS 4 or 5) TritonGPURemoveLayoutConversions failed ("'tt.load' op failed to verify that mask
type matches ptr type"), in the H200 ladder run at commit e0c0b5d (tree, context-512-choice-8). This module reproduced
it on a CPU-only machine with Triton 3.6.0 (SEARCH_STEPS 4 and 5 failed; 0-3, 8 and 12 compiled; Triton 3.9 compiled
all), and shows v3 compiling everywhere with both. `triton.compile` runs the whole pipeline down to a cubin with
Triton's bundled ptxas; nothing is launched. Must run without TRITON_INTERPRET (the kernels must be JITFunctions): tests
run it in a subprocess (tests/test_kernels.py).
"""

from __future__ import annotations

import itertools
import os
import sys

SM90 = 90
SEARCH_STEPS = (0, 1, 2, 3, 4, 8, 12)  # binary-search steps: (sequences - 1).bit_length(), up to 4,097 sequences


def compile_gdn_prep(search_steps: int, has_rows: bool, *, capability: int = SM90, qk_l2norm: bool = True) -> None:
    """Compile `_gdn_prep_kernel` at the 27B widths (as `kernels.gdn_prep` launches it) for `capability`; raises the
    compiler's error on failure."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kernels.gdn_prep import _gdn_prep_kernel

    if not isinstance(_gdn_prep_kernel, triton.runtime.JITFunction):
        raise RuntimeError("compile_check: the kernels were defined under TRITON_INTERPRET=1; run without it")
    types = {
        "proj_ptr": "*bf16",
        "conv_weight_ptr": "*bf16",
        "a_log_ptr": "*fp32",
        "dt_bias_ptr": "*bf16",
        "cu_seqlens_ptr": "*i32",
        "rows_ptr": "*i64",
        "q_ptr": "*bf16",
        "k_ptr": "*bf16",
        "v_ptr": "*bf16",
        "g_ptr": "*fp32",
        "beta_ptr": "*bf16",
        "tokens": "i32",
        "num_seqs": "i32",
        "proj_sr": "i32",
        "eps": "fp32",
    }
    constants = {
        "KEY_HEADS": 16,
        "VALUE_HEADS": 48,
        "KEY_DIM": 128,
        "VALUE_DIM": 128,
        "WIDTH": 4,
        "SEARCH_STEPS": search_steps,
        "QK_L2NORM": qk_l2norm,
        "HAS_ROWS": has_rows,
        "BLOCK_T": 16,
        "BLOCK_D": 128,
        "BLOCK_HV": 64,
        "TORCH_CPU": False,
    }
    names = _gdn_prep_kernel.arg_names
    signature = {name: types.get(name, "constexpr") for name in names}
    aligned = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(names) if name.endswith("_ptr")}
    source = ASTSource(_gdn_prep_kernel, signature, constants, aligned)
    triton.compile(
        source,
        target=GPUTarget("cuda", capability, 32),
        options={"num_warps": 4, "enable_fp_fusion": False},
    )


def check_gdn_prep(capability: int = SM90) -> list[tuple[int, bool, str | None]]:
    """(search_steps, has_rows, None or the first line of the error) for every specialisation in SEARCH_STEPS."""
    results = []
    for steps, has_rows in itertools.product(SEARCH_STEPS, (False, True)):
        try:
            compile_gdn_prep(steps, has_rows, capability=capability)
            results.append((steps, has_rows, None))
        except Exception as error:  # the compiler raises RuntimeError / CompilationError; report either
            results.append((steps, has_rows, (str(error).strip().splitlines() or [repr(error)])[-1]))
    return results


def main() -> int:
    import triton

    if os.environ.get("TRITON_INTERPRET") == "1":
        print("compile_check: unset TRITON_INTERPRET (the kernels must be compiled, not interpreted)", file=sys.stderr)
        return 2
    results = check_gdn_prep()
    print(f"gdn_prep for sm_{SM90}, Triton {triton.__version__}")
    for steps, has_rows, error in results:
        print(f"  SEARCH_STEPS={steps:<2} rows={'yes' if has_rows else 'no ':<3} {'ok' if error is None else error}")
    return 0 if all(error is None for *_, error in results) else 1


if __name__ == "__main__":
    sys.exit(main())
