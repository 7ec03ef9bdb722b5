"""The run environment (ablations/envinfo.py): names the record needs, the record stem, git state and its fallbacks."""

from __future__ import annotations

import subprocess
from pathlib import Path

from ablations import envinfo, records
from tests.cases import small_record


def test_environment_names_and_record_stem(monkeypatch):
    env = envinfo.collect("cpu")
    records.validate_record(small_record(env=env))  # every name the schema wants, with the right types
    assert env["device"] == "cpu" and env["gpu"] is None and env["cpu_count"] >= 1
    assert envinfo.record_stem({"utc": "2026-11-30T10:21:13Z", "gpu": "NVIDIA H200", "git_commit": "9a63d16abc"}) == (
        "20261130T102113Z-nvidia-h200-9a63d16"
    )
    assert envinfo.record_stem({"utc": "2026-11-30T10:21:13Z", "gpu": None, "git_commit": "unknown"}).endswith(
        "-cpu-unknown"
    )


def test_git_state_falls_back_to_the_sender_variables(monkeypatch):
    monkeypatch.setattr(envinfo, "_run", lambda args, cwd=None: None)
    monkeypatch.delenv("JEVLAB_GIT_COMMIT", raising=False)
    assert envinfo.git_state() == {"git_commit": "unknown", "git_dirty": True, "git_source": "none"}
    monkeypatch.setenv("JEVLAB_GIT_COMMIT", "feedbeef")
    monkeypatch.setenv("JEVLAB_GIT_DIRTY", "0")
    assert envinfo.git_state() == {"git_commit": "feedbeef", "git_dirty": False, "git_source": "env"}


def _git(cwd: Path, *args: str) -> str:
    done = subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=cwd, capture_output=True, text=True, check=True
    )
    return done.stdout.strip()


def _committed_checkout(root: Path) -> str:
    """A git checkout at `root` with code, a README with the generated block, and an output under results/."""
    start, end = envinfo.README_BLOCK
    (root / "results").mkdir(parents=True)
    (root / "code.py").write_text("x = 1\n")
    (root / "README.md").write_text(f"# lab\n\n{start}\nold table\n{end}\n\nmore text\n")
    (root / "results" / "ladder.png").write_bytes(b"old")
    _git(root, "init", "-q")
    _git(root, "add", ".")
    _git(root, "commit", "-qm", "c")
    return _git(root, "rev-parse", "HEAD")


def test_dirty_describes_the_code_not_the_outputs_a_run_writes(tmp_path):
    """What `nox -s ablate` rewrites (results/, README's generated block) and untracked files leave a checkout clean;
    a change to code, or to README outside the block, makes it dirty."""
    commit = _committed_checkout(tmp_path)
    assert envinfo.git_state(tmp_path) == {"git_commit": commit, "git_dirty": False, "git_source": "git"}
    readme = tmp_path / "README.md"
    (tmp_path / "results" / "ladder.png").write_bytes(b"new")
    (tmp_path / "results" / "run.json").write_text("{}")
    (tmp_path / "scratch.py").write_text("y = 2\n")
    readme.write_text(readme.read_text().replace("old table", "new table\n| with | rows |"))
    assert envinfo.code_dirty(tmp_path) is False
    readme.write_text(readme.read_text().replace("more text", "edited text"))
    assert envinfo.code_dirty(tmp_path) is True
    _git(tmp_path, "checkout", "README.md")
    start, end = envinfo.README_BLOCK
    readme.write_text(readme.read_text().replace(end, ""))  # a broken block cannot be told apart from an edit
    assert envinfo.code_dirty(tmp_path) is True
    _git(tmp_path, "checkout", "README.md")
    (tmp_path / "code.py").write_text("x = 2\n")
    assert envinfo.git_state(tmp_path)["git_dirty"] is True


def test_the_readme_block_is_the_one_the_figures_write():
    from paper import readme

    assert envinfo.README_BLOCK == (readme.README_START, readme.README_END)


def test_the_serving_block_is_an_output_too(tmp_path):
    """The serving block paper.figures writes leaves the checkout clean when it changes; text beside it does not."""
    from ablations.records import SERVING_BLOCK

    _committed_checkout(tmp_path)
    readme = tmp_path / "README.md"
    start, end = SERVING_BLOCK
    readme.write_text(readme.read_text() + f"\n{start}\nold serving\n{end}\ntail\n")
    _git(tmp_path, "commit", "-qam", "serving block")
    readme.write_text(readme.read_text().replace("old serving", "new serving\n| a | b |"))
    assert envinfo.code_dirty(tmp_path) is False
    readme.write_text(readme.read_text().replace("tail", "edited tail"))
    assert envinfo.code_dirty(tmp_path) is True


def test_a_copy_inside_another_repository_records_no_commit_of_it(tmp_path, monkeypatch):
    """An exported copy placed inside another git checkout: that checkout's commit is not this code's."""
    outer = tmp_path / "other"
    _committed_checkout(outer)
    copy = outer / "vendored" / "jevlab"
    copy.mkdir(parents=True)
    (copy / "code.py").write_text("x = 1\n")
    monkeypatch.delenv("JEVLAB_GIT_COMMIT", raising=False)
    assert envinfo.git_state(copy) == {"git_commit": "unknown", "git_dirty": True, "git_source": "none"}
    monkeypatch.setenv("JEVLAB_GIT_COMMIT", "feedbeef")
    monkeypatch.setenv("JEVLAB_GIT_DIRTY", "0")
    assert envinfo.git_state(copy) == {"git_commit": "feedbeef", "git_dirty": False, "git_source": "env"}


def test_the_senders_variables_win_over_a_copys_own_git(tmp_path, monkeypatch):
    """A lent GPU machine's copy carried a stale `.git` of its own: the variables the sender set name the code."""
    _committed_checkout(tmp_path)
    monkeypatch.delenv("JEVLAB_GIT_COMMIT", raising=False)
    assert envinfo.git_state(tmp_path)["git_source"] == "git"
    monkeypatch.setenv("JEVLAB_GIT_COMMIT", "feedbeef")
    monkeypatch.setenv("JEVLAB_GIT_DIRTY", "0")
    assert envinfo.git_state(tmp_path) == {"git_commit": "feedbeef", "git_dirty": False, "git_source": "env"}
