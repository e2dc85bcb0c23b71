"""The study-analysis notebook runs end to end (it makes its own tiny study)."""

from pathlib import Path

import pytest

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "study_analysis.ipynb"


@pytest.mark.slow
def test_study_notebook_executes(tmp_path):
    import nbformat  # here, not at collection: with jsonschema, a third of a second of every test worker's start
    from nbclient import NotebookClient

    notebook = nbformat.read(NOTEBOOK, as_version=4)
    client = NotebookClient(notebook, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}})
    client.execute()
    outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    images = [o for o in outputs if "image/png" in o.get("data", {})]
    assert len(images) == 2  # both plots shown
    text = "".join(o.get("text", "") for o in outputs)
    assert "critical batch estimate" in text
