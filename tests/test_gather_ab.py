"""`measure.gather_ab` on the CPU: another version of kernels/gdn_prep.py loads as its own module and gathers the bits
this tree's does (under the interpreter), bad files are refused, and without a GPU the probe exits with 2."""

from __future__ import annotations

import importlib
import shutil
from pathlib import Path

import pytest
import torch

from measure import gather_ab

PREP = importlib.import_module("kernels.gdn_prep")  # the module (the package exports the function of that name)

REPO = Path(__file__).resolve().parents[1]


def test_an_old_version_loads_and_gathers_the_same_bits(tmp_path) -> None:
    copy = tmp_path / "gdn_prep_old.py"
    shutil.copy(REPO / "kernels" / "gdn_prep.py", copy)
    old = gather_ab.load_version(copy)
    assert old is not PREP and old._gather_slots_kernel is not PREP._gather_slots_kernel
    generator = torch.Generator().manual_seed(3)
    n, slots = 7, 23
    bf16 = [torch.randn(1, n, heads, 8, generator=generator).bfloat16() for heads in (2, 2, 4)]
    prepared = (*bf16, -torch.rand(1, n, 4, generator=generator), torch.rand(1, n, 4, generator=generator).bfloat16())
    rows = torch.randint(0, n, (slots,), generator=generator)
    options = {"count": torch.tensor([19]), "linear_gates": True}
    mine = PREP.gather_slots(prepared, rows, **options)
    for a, b in zip(old.gather_slots(prepared, rows, **options), mine, strict=True):
        assert torch.equal(a[:, :19], b[:, :19])


def test_bad_files_are_refused(tmp_path) -> None:
    other = tmp_path / "norms.py"
    other.write_text("x = 1\n")
    with pytest.raises(ValueError, match="has no gather_slots"):
        gather_ab.load_version(other)
    with pytest.raises(SystemExit):
        gather_ab.main([str(tmp_path / "missing.py")])


def test_without_a_gpu_it_exits_with_2(tmp_path, capsys) -> None:
    if torch.cuda.is_available():
        pytest.skip("a GPU is here")
    copy = tmp_path / "gdn_prep_old.py"
    shutil.copy(REPO / "kernels" / "gdn_prep.py", copy)
    assert gather_ab.main([str(copy)]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
