"""The report ends with the answer a study is run for: how many GPUs, with which recipe."""

import pytest

from lbt.apps.report.answer import answer_lines, gpu_answer
from lbt.apps.report.rows import Row


def row(recipe: str, batch: int, acc: float, std: float = 0.0, seeds: int = 1, diverged: int = 0) -> Row:
    return Row(recipe=recipe, global_batch=batch, world_size=batch // 64, seeds=seeds, split="val", final_acc=acc,
               final_acc_std=std, best_acc=acc, test_acc=acc - 0.001, test_acc_std=None, gap=None, steps=1.0,
               steps_to_target=None, steps_to_target_std=None, samples_per_sec=1.0, diverged=diverged, errors=0,
               b_simple=None)


ROWS = [row("baseline", 64, 0.990), row("baseline", 1024, 0.985), row("baseline", 4096, 0.95, 0.01, 3),
        row("lars", 64, 0.985), row("lars", 1024, 0.984), row("lars", 4096, 0.981, 0.002, 3),
        row("lars", 8192, 0.96, 0.01, 3), row("lamb", 64, 0.97)]


def test_the_largest_batch_within_tolerance_per_recipe_and_the_answer():
    answer = gpu_answer(ROWS, tolerance=1.0)
    by = {r["recipe"]: r for r in answer["recipes"]}
    assert answer["reference"] == {"recipe": "baseline", "global_batch": 64, "acc": 0.990}
    assert (by["baseline"]["global_batch"], by["baseline"]["world_size"]) == (1024, 16)
    assert (by["lars"]["global_batch"], by["lars"]["world_size"], by["lars"]["next_batch"]) == (4096, 64, 8192)
    assert by["lamb"]["global_batch"] is None  # 2 points below at its only batch
    assert answer["best"]["recipe"] == "lars"
    text = "\n".join(answer_lines(answer))
    assert "**Answer: up to 64 GPUs (global batch 4,096) with lars**" in text
    assert "98.10 ± 0.20 (3)" in text  # the spread over seeds


def test_the_tolerance_moves_the_answer():
    assert gpu_answer(ROWS, tolerance=0.5)["best"]["global_batch"] == 1024  # only baseline's 1,024 is within
    assert gpu_answer(ROWS, tolerance=5.0)["best"]["global_batch"] == 8192


def test_a_diverged_batch_does_not_count():
    rows = ROWS + [row("lars", 16384, 0.99, diverged=1)]
    assert gpu_answer(rows, tolerance=1.0)["best"]["global_batch"] == 4096


def test_lbt_study_checks_its_report_options_before_running(tmp_path, capfd, monkeypatch):
    from test_cli_errors import run_main

    monkeypatch.chdir(tmp_path)
    code, err = run_main(["study", "--target", "95", "hydra.sweep.dir=" + str(tmp_path / "s")], capfd)
    assert code == 2 and "write 95%" in err and not (tmp_path / "s").exists()


@pytest.mark.parametrize("value, ok", [("0.5", True), ("0", False), ("abc", False)])
def test_tolerance_points(value, ok):
    import argparse

    from lbt.apps.report.cli import points

    if ok:
        assert points(value) == 0.5
    else:
        with pytest.raises(argparse.ArgumentTypeError):
            points(value)


@pytest.mark.parametrize("step_ms", [None, 2.0])
def test_time_to_accuracy_on_a_network(tmp_path, step_ms):
    """With --network: steps to target (measured) x the step time lbt plan predicts at each world size."""
    import json

    from conftest import FAST, compose_config
    from test_study import _job

    from lbt.apps.report import write_report

    config, _ = compose_config(FAST + ["model=mlp"])  # resolved, as a run saves it in result.json
    for n, (world_size, accs) in enumerate([(1, [0.8, 0.95]), (4, [0.7, 0.94]), (16, [0.5, 0.9])]):
        _job(tmp_path / str(n), "baseline", world_size, 0, accs, b_simple=200.0, test=accs[-1])
        result = json.loads((tmp_path / str(n) / "result.json").read_text())
        (tmp_path / str(n) / "result.json").write_text(json.dumps({**result, "config": config}))
    summary = write_report(tmp_path, target=0.85, tolerance=2.0, network="10gbe", step_ms=step_ms)
    tta = summary["gpu_answer"]["time_to_accuracy"]
    assert {o["world_size"] for o in tta["options"]} == {1, 4}  # 16 lost more than 2 points
    for option in tta["options"]:
        assert option["seconds"] == pytest.approx(option["steps_to_target"] * option["step_s"])
    assert tta["best"] == min(tta["options"], key=lambda o: o["seconds"])
    if step_ms is not None:
        assert tta["options"][0]["world_size"] == 1 and tta["options"][0]["step_s"] == pytest.approx(2e-3)
    assert "**Fastest within the tolerance:" in (tmp_path / "report.md").read_text()
