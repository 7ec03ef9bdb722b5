"""GPU tests of the fused kernels (27B shapes, H200): random activations at realistic scales, and the per-kernel
bit-identity table on activations captured from the 27B reference forward (hf_fla) of the drone request.

The table code lives in `ablations/bit_identity.py` (the runner records the same table):
`bit_identity_table(activations, shapes)` runs every kernel whose inputs are in `activations` on NaN-poisoned outputs
and compares with `reference.ops` on the same device, one row per output; `capture_activations(hf_backbone,
candidates, groups, layers=...)` builds such a dict per layer from the HF forward. `random_activations(shapes,
seq_lens, device, seed)` (tests/cases.py, shared with tests/test_kernels.py) builds one from seeded random data.

Expected exactness (reasons in each kernel module's docstring), asserted by `check_rows`:
* bitwise: silu_mul, attention_gate, the new residual, gdn_prep v / beta / g, attn_prep v;
* after a sum of squares (Triton sums in another order than torch, so the normalised n can be one bf16 ulp off), at
  most 1e-4 of the elements differ: by one bf16 ulp at most where n is the output (the normed residual, gdn_prep
  q / k); only as the reference's own chain after n gives them from n moved by one ulp (the flip model, any number
  of output ulps) where rounded arithmetic follows n (the gated norm, attn_prep q / k);
* against FLA's own `l2norm_fwd` (the engine's real reference for q / k) the one-ulp bound, printed separately.
Synthetic data and weights: the shares say nothing about model accuracy, only about fidelity to the reference ops.
"""

from __future__ import annotations

import pytest
import torch

from ablations.bit_identity import (
    KERNELS,
    bit_identity_table,
    capture_activations,
    captured_table,
    check_rows,
    compare,
    format_table,
    representative_layers,
)
from reference.shapes import QWEN38_27B
from tests.cases import (
    check_bf16_rounding_matches_torch,
    check_gates_on_every_bf16_input,
    check_prep_ways,
    check_row_indexed_kernels,
    random_activations,
)

GPU_ROWS = (1, 7, 63, 65, 277, 1000)


# ---------------------------------------------------------------------------------------------------------------------
# GPU tests


def _require_compiled_kernels() -> None:
    import triton

    from kernels import activations

    if not isinstance(activations._silu_mul_kernel, triton.runtime.JITFunction):
        pytest.skip("kernels were defined under TRITON_INTERPRET=1; the GPU tests need them compiled (unset it)")


@pytest.mark.gpu
def test_gpu_round_to_bf16_matches_torch() -> None:
    """The compiled rounding (the hardware conversion, widened back by bits) equals torch's CUDA conversion."""
    _require_compiled_kernels()
    check_bf16_rounding_matches_torch("cuda")


@pytest.mark.gpu
def test_gpu_gates_on_every_bf16_input() -> None:
    """The compiled gates' fast path (`kernels.numerics.silu_bf16`, `sigmoid_bf16`: approximate exp2 and reciprocal,
    torch's exact path near a rounding midpoint) gives torch's CUDA silu and sigmoid bits on every one of the 65,536
    bf16 inputs, inside silu_mul, attention_gate and gdn_prep (tests/cases.py): all the inputs there are."""
    _require_compiled_kernels()
    check_gates_on_every_bf16_input(QWEN38_27B, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("rows", GPU_ROWS)
def test_gpu_bit_identity_27b(rows: int) -> None:
    """Every kernel on one sequence of `rows` tokens at the 27B shapes, against reference.ops on the GPU."""
    _require_compiled_kernels()
    table = bit_identity_table(random_activations(QWEN38_27B, [rows], "cuda", seed=rows), QWEN38_27B)
    print(f"\n27B, {rows} rows\n{format_table(table)}")
    assert len(table) == 13
    check_rows(table)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "path_lens",
    [[300, 1, 277, 393], [64, 0, 3, 129, 70, 1, 65, 200, 31, 90], [4] * 255],
    ids=["4-paths", "10-paths", "255-paths"],
)
def test_gpu_row_indexed_kernels_27b(path_lens: list[int]) -> None:
    """`check_row_indexed_kernels` at the 27B shapes: drone-like output (337) and key (1300) counts; 4, 10 and 255
    paths, so gdn_prep's binary search over the sequence starts takes 2, 4 and 8 steps (Triton 3.6 failed to compile
    the row-indexed kernel from 4 steps on before gdn_prep v3)."""
    _require_compiled_kernels()
    check_row_indexed_kernels(
        QWEN38_27B, "cuda", source_rows=400, path_lens=path_lens, out_rows=337, keys=1300, seed=8,
        index_dtype=torch.int64,
    )  # fmt: skip


@pytest.mark.gpu
def test_gpu_packed_sequences_27b() -> None:
    """gdn_prep over packed sequences (an empty one included) restarts the conv history at every sequence start."""
    _require_compiled_kernels()
    lens = [1, 7, 0, 63, 65, 277]
    table = bit_identity_table(random_activations(QWEN38_27B, lens, "cuda", seed=5), QWEN38_27B, kernels=["gdn_prep"])
    print(f"\n27B gdn_prep, packed {lens}\n{format_table(table)}")
    check_rows(table)


@pytest.mark.gpu
def test_gpu_gated_rmsnorm_bf16_weight_27b() -> None:
    """The gated norm with a bf16 weight (transformers' from_pretrained(dtype=bf16) casts it): round 2 applies."""
    _require_compiled_kernels()
    act = random_activations(QWEN38_27B, [277], "cuda", seed=11)
    act["gdn_norm_weight"] = act["gdn_norm_weight"].to(torch.bfloat16)
    table = bit_identity_table(act, QWEN38_27B, kernels=["gated_rmsnorm"])
    print(f"\n{format_table(table)}")
    check_rows(table)


@pytest.mark.gpu
def test_gpu_qk_l2norm_against_fla_27b() -> None:
    """gdn_prep's fused q/k l2norm against FLA's own l2norm_fwd on the unnormalised conv outputs: the numbers the
    engine's FLA call would otherwise compute inside `chunk_gated_delta_rule(use_qk_l2norm_in_kernel=True)`."""
    _require_compiled_kernels()
    l2norm_fwd = pytest.importorskip("fla.modules.norm.l2norm").l2norm_fwd
    import kernels

    sh = QWEN38_27B
    act = random_activations(sh, [1, 63, 1000], "cuda", seed=3)
    dims = {
        "num_k_heads": sh.linear_num_key_heads,
        "num_v_heads": sh.linear_num_value_heads,
        "head_k_dim": sh.linear_key_head_dim,
        "head_v_dim": sh.linear_value_head_dim,
    }
    args = (act["gdn_proj"], act["conv_weight"], act["A_log"], act["dt_bias"], act["gdn_cu_seqlens"])
    q_raw, k_raw, *_ = kernels.gdn_prep(*args, qk_l2norm=False, **dims)
    q, k, *_ = kernels.gdn_prep(*args, qk_l2norm=True, **dims)
    table = [
        compare("gdn_prep vs FLA", "q", q, l2norm_fwd(q_raw)[0]),
        compare("gdn_prep vs FLA", "k", k, l2norm_fwd(k_raw)[0]),
    ]
    print(f"\n{format_table(table)}")
    check_rows(table)


@pytest.mark.gpu
def test_gpu_batch_invariance_27b() -> None:
    """A row's bits do not depend on the other rows of the call (tile shapes are fixed by widths, not row counts):
    residual_rmsnorm and attn_prep on rows 0..R-1 equal the same rows inside a 1000-row call."""
    _require_compiled_kernels()
    import kernels

    sh = QWEN38_27B
    act = random_activations(sh, [1000], "cuda", seed=9)
    dims = {"num_heads": sh.num_attention_heads, "num_kv_heads": sh.num_key_value_heads, "head_dim": sh.head_dim}
    norm_weights = (act["q_norm_weight"], act["k_norm_weight"])
    full = kernels.residual_rmsnorm(act["residual"], act["delta"], act["norm_weight"], sh.rms_norm_eps)[1]
    full_q = kernels.attn_prep(act["attn_proj"], *norm_weights, act["cos"], act["sin"], sh.rms_norm_eps, **dims)[0]
    for count in (1, 7, 277):
        rows = slice(0, count)
        part = kernels.residual_rmsnorm(act["residual"][rows], act["delta"][rows], act["norm_weight"], sh.rms_norm_eps)
        assert torch.equal(part[1].view(torch.int16), full[rows].view(torch.int16)), count
        tables = (act["cos"][rows], act["sin"][rows])
        part_q = kernels.attn_prep(act["attn_proj"][rows], *norm_weights, *tables, sh.rms_norm_eps, **dims)[0]
        assert torch.equal(part_q.view(torch.int16), full_q[rows].view(torch.int16)), count


@pytest.mark.gpu
def test_gpu_bit_identity_on_captured_drone_activations_27b() -> None:
    """Every kernel on the inputs the 27B reference (hf_fla, synthetic weights) really computes for the drone request
    at layers 0 (GDN), 3 (attention), 62 (GDN) and 63 (attention), all 971 real tokens: the documented exactness."""
    _require_compiled_kernels()
    from reference.data import open_jev_workloads
    from reference.model import HFBackbone
    from reference.service import DecisionModel
    from reference.weights import synthetic_weights

    weights = synthetic_weights(QWEN38_27B, seed=0, device="cuda")
    backbone = HFBackbone(weights, "fla")
    plan = DecisionModel(backbone, weights).plan(open_jev_workloads()["drone"]["request"])
    layers = representative_layers(QWEN38_27B)
    assert layers == [0, 3, 62, 63]
    with torch.inference_mode():
        captured = capture_activations(backbone, plan.candidates, plan.groups, layers=layers)
        table = captured_table(captured, QWEN38_27B)
    del captured, backbone, weights  # ~54 GB: free before the assertions (a failure's traceback keeps the frame)
    torch.cuda.empty_cache()
    tokens = sum(len(ids) for ids in plan.candidates)
    print(f"\n27B hf_fla, drone ({tokens} tokens, {len(plan.candidates)} candidates)\n{format_table(table)}")
    assert {r["kernel"] for r in table} == set(KERNELS)
    assert len(table) == 2 * 9 + 2 * 7  # GDN layer: 9 outputs, attention layer: 7
    assert all(r["elements"] > 0 and r["layer"] in layers for r in table)
    check_rows(table)


@pytest.mark.gpu
@pytest.mark.parametrize("workload_id", ["drone", "customer_service"])
def test_gpu_packed_prep_equals_every_slot_27b(workload_id: str) -> None:
    """tests/test_kernels.py::test_packed_prep_equals_every_slot_on_a_bucketed_plan at the 27B widths on the GPU
    (`tests.cases.check_prep_ways`): gdn_prep from the plan's `conv_taps` and at `plan.row_slot`, each then gathered,
    and attn_prep over the rows then gathered at the key rows, equal the kernels over every path slot and key entry."""
    _require_compiled_kernels()
    check_prep_ways(workload_id, QWEN38_27B, "cuda")
