"""conf/ and recipes/ are found from a plain (non-editable) `pip install .` too, built without a warning."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_installed_wheel_finds_its_configs(tmp_path):
    target = tmp_path / "site"
    built = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-v", "--no-deps", "--no-build-isolation", "--target", str(target),
         str(REPO)],
        check=True, capture_output=True, text=True,
    )
    # No setuptools warning: a license table (deprecated), or a conf/ folder "absent from the `packages`
    # configuration", each adds lines to `make setup` (about 1,090 in all when both were there).
    assert "Warning" not in built.stdout + built.stderr.replace("WARNING: Location", ""), built.stderr[-2000:]
    assert (target / "lbt" / "conf" / "config.yaml").is_file()
    assert (target / "lbt" / "conf" / "recipe" / "baseline.yaml").is_file()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {**os.environ, "PYTHONPATH": str(target)}
    out = subprocess.run(
        [sys.executable, "-m", "lbt", "train", "data=synthetic", "model=mlp", "trainer.epochs=1",
         "trainer.progress=false", "recipe=baseline", "hydra.run.dir=run"],
        cwd=elsewhere, env=env, capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert str(target / "lbt" / "conf") in subprocess.run(
        [sys.executable, "-c", "import lbt.apps.compose; print(lbt.apps.compose.conf_dir())"],
        cwd=elsewhere, env=env, capture_output=True, text=True,
    ).stdout
    assert (elsewhere / "run" / "result.json").is_file()


@pytest.mark.slow
def test_each_checkout_has_its_own_venv():
    """A venv shared between clones (keyed by pyproject.toml) ran whichever clone last set it up."""
    import shutil

    if shutil.which("make") is None:
        raise AssertionError("make is needed: the README's two commands are make targets")
    repo = Path(__file__).resolve().parents[1]
    dry = subprocess.run(["make", "-n", "test"], cwd=repo, capture_output=True, text=True, timeout=60)
    assert dry.returncode == 0, dry.stderr
    assert f"{repo}/.venv/bin/python -m pytest" in dry.stdout
    assert ".venv/" in (repo / ".gitignore").read_text().splitlines()


def test_token_folders_the_docs_write_are_ignored_by_git():
    """`lbt tokens input.txt data/bytes` (docs/language-models.md) writes into data/, which git must ignore."""
    assert "data/bytes" in (REPO / "docs" / "language-models.md").read_text()
    assert "/data/" in (REPO / ".gitignore").read_text().splitlines()
