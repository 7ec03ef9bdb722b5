"""`measure.ncu_regions` on a small hand-written Nsight Compute source export: the widest loop found from its backward
branches (not an inner one), each region's samples and executed instructions, the share at instructions every warp
executes once, the stall reasons, the loop's stages between tensor-core dots, and a clear refusal of a kernel that is
not in the file."""

from __future__ import annotations

import gzip

import pytest

from measure.ncu_regions import kernel_rows, main, summary

HEADER = (
    '"Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed","stall_long_sb",'
    '"stall_barrier","stall_long_sb (Not Issued)"'
)
# 4 warps; a prologue of 2, an outer loop 0x20-0x60 (2 iterations) holding an inner loop 0x30-0x40, one after
KERNEL = [
    ("0x1000", "LDC R1, c[0x0][0x28]", 5, 4, 5, 0),
    ("0x1010", "ATOMG.E.ADD PT, R5, [R4.64], R7", 10, 4, 0, 10),
    ("0x1020", "LDG.E R2, [R8.64]", 20, 8, 20, 0),
    ("0x1030", "FADD R3, R3, R2", 3, 24, 0, 0),
    ("0x1040", "@P0 BRA 0x1030", 1, 24, 0, 0),
    ("0x1050", "HGMMA.64x64x16.F32.BF16 R152, gdesc[UR44], R152", 30, 8, 0, 30),
    ("0x1060", "@P1 BRA 0x1020", 1, 8, 0, 0),
    ("0x1070", "EXIT", 30, 4, 0, 0),
]


def write_export(path, kernels: dict[str, list[tuple]]) -> str:
    lines = []
    for name, rows in kernels.items():
        lines += [f'"Kernel Name","{name}",', HEADER]
        lines += [",".join(f'"{v}"' for v in (*row, 0)) for row in rows]
    target = path / "source.csv.gz"
    with gzip.open(target, "wt") as f:
        f.write("\n".join(lines) + "\n")
    return str(target)


def test_regions_of_the_widest_loop(tmp_path):
    path = write_export(tmp_path, {"_other_kernel": KERNEL[:2], "_walk_kernel": KERNEL})
    out = summary(kernel_rows(path, "_walk"))
    total = sum(row[2] for row in KERNEL)
    assert out["samples"] == total and out["warp_instructions"] == sum(row[3] for row in KERNEL)
    regions = out["regions"]
    assert [regions[name]["instructions"] for name in ("prologue", "loop", "after")] == [2, 5, 1]
    assert regions["prologue"]["samples_share"] == pytest.approx(15 / total)
    assert regions["loop"]["samples_share"] == pytest.approx(55 / total)
    assert regions["loop"]["warp_instructions"] == 8 + 24 + 24 + 8 + 8
    assert out["every_warp_samples_share"] == pytest.approx(45 / total)  # executed 4 times: once per warp
    assert out["reasons"] == pytest.approx({"barrier": 40 / total, "long_sb": 25 / total})
    assert out["top"][0][:2] == ("HGMMA.64x64x16.F32.BF16 R152, gdesc[UR44], R152", pytest.approx(30 / total))


# a loop of two dot stages after its loads: stage 0 the loads, then each WARPGROUP.ARRIVE opens a stage
STAGED = [
    ("0x2000", "LDC R1, c[0x0][0x28]", 2, 4, 0, 0),
    ("0x2010", "LDG.E R2, [R8.64]", 40, 8, 40, 0),
    ("0x2020", "WARPGROUP.ARRIVE", 1, 8, 0, 0),
    ("0x2030", "HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], RZ", 9, 8, 0, 9),
    ("0x2040", "WARPGROUP.ARRIVE", 1, 8, 0, 0),
    ("0x2050", "@P2 HGMMA.64x64x16.F32.BF16 R88, gdesc[UR8], R88", 7, 8, 0, 7),
    ("0x2060", "@P1 BRA 0x2010", 0, 8, 0, 0),
    ("0x2070", "EXIT", 0, 4, 0, 0),
]


def test_the_loop_is_cut_into_stages_at_each_warpgroup_arrive(tmp_path, capsys):
    path = write_export(tmp_path, {"_walk_kernel": STAGED})
    stages = summary(kernel_rows(path, "_walk"))["loop_stages"]
    total = sum(row[2] for row in STAGED)
    assert [stage["instructions"] for stage in stages] == [1, 2, 3]
    assert [stage["dots"] for stage in stages] == [[], ["HGMMA.64x128x16.F32.BF16"], ["HGMMA.64x64x16.F32.BF16"]]
    assert [stage["samples_share"] for stage in stages] == pytest.approx([40 / total, 10 / total, 8 / total])
    assert stages[0]["top_reason"] == ("long_sb", 1.0) and stages[1]["top_reason"] == ("barrier", 1.0)
    assert main([path, "_walk"]) == 0 and "loop stage 2" in capsys.readouterr().out


def test_a_kernel_not_in_the_export_is_refused(tmp_path, capsys):
    path = write_export(tmp_path, {"_walk_kernel": KERNEL})
    with pytest.raises(SystemExit, match="no section"):
        kernel_rows(path, "_solve")
    with pytest.raises(SystemExit, match="no loop"):
        summary(kernel_rows(path, "_walk")[:3])
    assert main([path, "_walk"]) == 0 and "prologue" in capsys.readouterr().out
