"""docs/own-model.md (the README's "Your own model and data" links there), run word for word: a model and
data of a package of your own."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
OWN_MODEL_PAGE = REPO / "docs" / "own-model.md"


def own_model_block() -> str:
    """The first ```bash block of docs/own-model.md: the worked example this file runs (and
    tests/test_readme_commands.py leaves to it, as its commands need the package it writes)."""
    return re.search(r"```bash\n(.*?)```", OWN_MODEL_PAGE.read_text(), re.S).group(1)


@pytest.mark.slow
def test_the_own_model_page_works_as_written(tmp_path):
    # MNIST-1D comes from the cache the rest of the suite fills (~/.cache/lbt/data): generating it is ~30 s.
    block = own_model_block()
    # `lbt` is the command of this interpreter's environment; the block itself runs unchanged.
    script = f'set -euo pipefail\nlbt() {{ "{sys.executable}" -m lbt "$@"; }}\n{block}'
    result = subprocess.run(["bash", "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "Traceback" not in result.stderr

    runs = {name: json.loads((tmp_path / "runs" / "mine" / name / "result.json").read_text())
            for name in ("mnist1d", "w1", "w16")}
    assert runs["mnist1d"]["config"]["model"]["_target_"] == "mypackage.MyNet"
    assert runs["mnist1d"]["config"]["model"]["width"] == 64 and runs["mnist1d"]["final_val_acc"] > 0.3
    for name, world_size in (("w1", 1), ("w16", 16)):
        run = runs[name]
        assert run["config"]["data"]["dataset"] == "mypackage.my_data" and run["world_size"] == world_size
        assert run["eval_split"] == "val" and run["final_val_acc"] > 0.8 and run["test_acc"] > 0.8  # learnable
    assert runs["w16"]["global_batch"] == 1024
    # lbt plan took the class: profiled here, and from a given step time, its plot where it was asked.
    assert result.stdout.count("gradient: ") == 2 and "given: a step of 1.5 ms" in result.stdout
    assert (tmp_path / "runs" / "mine" / "plan_gpu.png").stat().st_size > 0
    assert (tmp_path / "runs" / "plan" / "plan.png").is_file()  # the default place, not the current folder
    assert not (tmp_path / "plan.png").exists()


@pytest.mark.slow
def test_own_data_of_the_wrong_shape_is_one_line(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text(
        "import torch\n"
        "def data():\n"
        "    t = torch.utils.data.TensorDataset(torch.randn(64, 8), torch.zeros(64, dtype=torch.long))\n"
        "    return t, t\n")
    result = subprocess.run(
        [sys.executable, "-m", "lbt", "train", "data=custom", "data.dataset=pkg.data", "data.num_classes=2",
         "data.input_shape=[40]", "trainer.progress=false", f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120, env={**__import__("os").environ,
                                                                        "PYTHONPATH": str(tmp_path)})
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert "data.input_shape=[40] but pkg.data's samples have shape [8]" in lines[0]
