"""The study report leads with one critical-batch figure, and no line of its accuracy plot contradicts its points."""

from __future__ import annotations

import json

import pytest

from lbt.apps.report import write_report
from lbt.metrics.critical import b_simple_undefined, run_optimizer

SGD, LARS = "torch.optim.SGD", "lbt.optim.LARS"


def job(folder, recipe: str, world_size: int, acc: float, b_simple: float, optimizer: str, seed: int = 0,
        diverged: bool = False) -> None:
    """A job folder as `lbt train -m` leaves it (its result.json, the trainer's fields)."""
    folder.mkdir(parents=True)
    batch = 64 * world_size
    steps = 10 * 8192 // batch
    history = [{"step": steps * (e + 1) // 2, "samples_seen": 40_960 * (e + 1), "global_batch": batch,
                "acc": acc - 0.05 * (1 - e), "loss": 1.0} for e in range(2)]
    (folder / "result.json").write_text(json.dumps({
        "recipe": recipe, "overrides": [f"dist.world_size={world_size}", f"trainer.seed={seed}"],
        "world_size": world_size, "procs": 1, "per_worker_batch": 64, "global_batch": batch,
        "seed": seed, "eval_split": "val", "final_val_acc": acc, "best_val_acc": acc, "test_acc": acc, "steps": steps,
        "samples_per_sec": 1000.0, "diverged": diverged, "val_history": history,
        "config": {"optim": {"_target_": "lbt.optim.create_optimizer", "optimizer_class": optimizer}},
        "technique_curves": {"gns/b_simple": [[40_960, b_simple], [81_920, b_simple]]},
    }))


# baseline holds within 1 point up to 1,024 and loses 5 points at 4,096; lars holds to 4,096, loses 8 at 8,192.
ACCS = {("baseline", 1): 0.98, ("baseline", 16): 0.975, ("baseline", 64): 0.93, ("lars", 1): 0.98,
        ("lars", 16): 0.979, ("lars", 64): 0.972, ("lars", 128): 0.90}


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    """A two-recipe study whose SGD baseline and LARS both measured B_simple = 158, and its report."""
    folder = tmp_path_factory.mktemp("study")
    for n, ((recipe, world_size), acc) in enumerate(ACCS.items()):
        job(folder / str(n), recipe, world_size, acc, b_simple=158.0, optimizer=SGD if recipe == "baseline" else LARS)
    return folder, write_report(folder)


def test_summary_holds_the_sweeps_critical_batch_and_the_diagnostics_apart(study):
    folder, summary = study
    crit = json.loads((folder / "summary.json").read_text())["critical_batch"]
    assert crit == summary["critical_batch"]
    held = max(64 * w for (recipe, w), acc in ACCS.items() if 100 * (0.98 - acc) <= 1.0)  # within 1 point of the base
    assert crit["value"] == crit["held"] == held == 4096
    assert (crit["recipe"], crit["failed"], crit["metric"], crit["tolerance"]) == ("lars", 8192, "acc", 1.0)
    assert crit["method"] == "sweep: largest global batch within tolerance of the base batch"
    assert crit["failed_by"] == pytest.approx(8.0) and crit["runs"] == len(ACCS)
    assert crit["base"] == {"recipe": "baseline", "global_batch": 64, "acc": 0.98}
    fit, b_simple = crit["diagnostics"]["steps_to_target_fit"], crit["diagnostics"]["b_simple"]
    assert fit["value"] == crit["fit"] and "steps to a target" in fit["why_it_differs"]
    # B_simple from the SGD baseline (the fit's series, lars, is stepped by LARS), with why it differs
    assert (b_simple["value"], b_simple["series"], b_simple["reason"]) == (158.0, "baseline", None)
    assert "arXiv:2505.23971" in b_simple["why_it_differs"]
    assert crit["ratio"] is None  # the fit and B_simple come from different series: no ratio between them


def test_report_md_leads_with_that_figure_and_moves_the_estimates_to_diagnostics(study):
    folder, _ = study
    lines = (folder / "report.md").read_text().splitlines()
    assert lines[0] == "# lbt study report"
    lead = lines[2]
    assert lead.startswith("**Critical batch: 4,096** (global batch, lars; measured: the largest global batch whose "
                           "mean final val accuracy stays within 1 point of the base batch's, from 7 runs")
    assert "the next batch tried, 8,192, was 8 points worse (90.00%)" in lead and "between 4,096 and 8,192" in lead
    assert sum("**Critical batch" in line for line in lines) == 1  # one figure; the others are diagnostics
    heading = lines.index("## Diagnostics: other estimates of the critical batch")
    assert not any("B_simple" in line or "bootstrap" in line for line in lines[:heading])  # no estimate before it
    diagnostics = "\n".join(lines[heading:])
    assert "From steps to target (lars" in diagnostics and "not the final accuracy" in diagnostics
    assert "B_simple (baseline, median over runs" in diagnostics and "Merrill et al. 2025" in diagnostics


def test_the_accuracy_plot_draws_only_the_lead_figure(study):
    _, summary = study
    drawn = summary["plot_lines"]["accuracy_vs_batch.png"]  # the x of every vertical line on the figure
    assert drawn == [summary["critical_batch"]["value"]]
    assert 158.0 not in drawn  # B_simple, far below where every recipe still holds, is not drawn


def test_lars_rows_say_b_simple_is_not_defined(study):
    folder, summary = study
    rows = {(r["recipe"], r["global_batch"]): r for r in summary["rows"]}
    assert rows[("lars", 4096)]["b_simple"] is None and rows[("lars", 4096)]["optimizer"] == "LARS"
    assert rows[("baseline", 64)]["b_simple"] == 158.0
    report = (folder / "report.md").read_text()
    assert "| 4,096 | 64 | 1 | 97.20 |" in report and "| not defined for LARS |" in report


def test_b_simple_is_not_defined_for_an_optimizer_whose_step_is_not_the_gradient(tmp_path):
    for n, (world_size, acc) in enumerate(((1, 0.98), (16, 0.978), (64, 0.95))):
        job(tmp_path / str(n), "lars", world_size, acc, b_simple=500.0, optimizer=LARS)
    crit = write_report(tmp_path)["critical_batch"]
    assert crit["gns"] is None and crit["gns_note"].startswith("not defined for LARS")
    assert crit["diagnostics"]["b_simple"]["value"] is None
    assert crit["diagnostics"]["b_simple"]["reason"] == crit["gns_note"]
    assert "B_simple (lars): not defined for LARS (its step is not the raw gradient" in (
        tmp_path / "report.md").read_text()


def test_seeds_spread_and_an_open_bracket(tmp_path):
    """Three seeds at the largest batch (the spread is said), and no larger batch tried (at least, not between)."""
    n = 0
    for world_size, accs in ((1, [0.98]), (16, [0.975, 0.977, 0.973])):
        for seed, acc in enumerate(accs):
            job(tmp_path / str(n), "baseline", world_size, acc, b_simple=100.0, optimizer=SGD, seed=seed)
            n += 1
    crit = write_report(tmp_path)["critical_batch"]
    assert (crit["value"], crit["failed"], crit["seeds"], crit["runs"]) == (1024, None, 3, 4)
    lead = (tmp_path / "report.md").read_text().splitlines()[2]
    assert "97.50% (mean of 3 seeds ± 0.2 points; 0.5 points worse than the base)" in lead
    assert "no larger batch was tried: the critical batch is at least 1,024" in lead


def test_a_diverged_next_batch_closes_the_bracket(tmp_path):
    for n, (world_size, acc, diverged) in enumerate(((1, 0.98, False), (16, 0.975, False), (64, 0.1, True))):
        job(tmp_path / str(n), "baseline", world_size, acc, b_simple=100.0, optimizer=SGD, diverged=diverged)
    summary = write_report(tmp_path)
    crit = summary["critical_batch"]
    assert (crit["value"], crit["failed"], crit["failed_value"], crit["failed_by"]) == (1024, 4096, None, None)
    assert "the next batch tried, 4,096, diverged or failed: the critical batch lies between 1,024 and 4,096" in (
        tmp_path / "report.md").read_text().splitlines()[2]
    assert summary["plot_lines"]["accuracy_vs_batch.png"] == [1024.0]


@pytest.mark.parametrize("optim, name, defined", [
    ({"optimizer_class": SGD}, "SGD", True), ({"optimizer_class": LARS}, "LARS", False),
    ({"optimizer_class": "lbt.optim.LAMB"}, "LAMB", False), ({"optimizer_class": "torch.optim.AdamW"}, "AdamW", False),
    ({"_target_": "torch.optim.SGD"}, "SGD", True), ({}, None, True),  # an old result.json: not known, kept
])
def test_b_simple_is_defined_for_plain_sgd_only(optim, name, defined):
    assert run_optimizer({"optim": optim}) == name
    assert (b_simple_undefined(name) is None) == defined


def test_a_held_batch_better_than_the_base_is_said_better_and_gpus_in_the_singular(tmp_path):
    """`lbt report DIR --tolerance 0.5` wrote "-0.17 points worse" for a held batch above the base, and
    "up to 1 GPUs" where only the base batch held; it left an earlier report's accuracy_vs_gpus.png in place."""
    for n, (world_size, acc) in enumerate(((1, 0.98), (16, 0.9817), (64, 0.95))):
        job(tmp_path / str(n), "baseline", world_size, acc, b_simple=100.0, optimizer=SGD)
    write_report(tmp_path, tolerance=0.5)
    lead = (tmp_path / "report.md").read_text().splitlines()[2]
    assert "0.17 points better than the base" in lead and "-0.17" not in lead, lead
    other = tmp_path / "other"
    for n, (world_size, acc) in enumerate(((1, 0.98), (16, 0.9), (64, 0.8))):
        job(other / str(n), "baseline", world_size, acc, b_simple=100.0, optimizer=SGD)
    (other / "accuracy_vs_gpus.png").write_bytes(b"an earlier report's, with a hybrid section")
    summary = write_report(other, tolerance=0.5, hybrid_cap=1_000_000)
    report = (other / "report.md").read_text()
    assert "**Answer: up to 1 GPU (global batch" in report and "1 GPUs" not in report
    gpus = other / "accuracy_vs_gpus.png"  # this report's figure, or none: never the earlier one
    assert ("accuracy_vs_gpus.png" in summary["files"]) == gpus.exists()
    assert not gpus.exists() or gpus.read_bytes().startswith(b"\x89PNG")


@pytest.mark.parametrize("lars_64, baseline_64, says", [
    (0.85, 0.90, "the next batch tried, 4,096, was 8 points worse (90.00%)"),  # baseline's own, not LARS's 85%
    (0.97, None, "no larger batch was tried"),  # baseline stopped at 1,024: LARS's 4,096 is not its next batch
])
def test_the_next_batch_tried_is_the_held_recipes_own(tmp_path, lars_64, baseline_64, says):
    """`lbt report DIR --tolerance 0.5` on a two-recipe study: the lead sentence brackets the critical batch with
    the next batch the held recipe tried and that recipe's value there, never another recipe's."""
    accs = {("baseline", 1): 0.98, ("baseline", 16): 0.979, ("lars", 1): 0.98, ("lars", 16): 0.9,
            ("lars", 64): lars_64}
    if baseline_64 is not None:
        accs["baseline", 64] = baseline_64
    for n, ((recipe, world_size), acc) in enumerate(accs.items()):
        job(tmp_path / str(n), recipe, world_size, acc, b_simple=100.0, optimizer=SGD)
    summary = write_report(tmp_path, tolerance=0.5)
    lead = (tmp_path / "report.md").read_text().splitlines()[2]
    assert "**Critical batch: 1,024** (global batch, baseline;" in lead and says in lead, lead
    assert "85.00" not in lead and "97.00" not in lead
    assert summary["critical_batch"]["failed"] == (4096 if baseline_64 else None)
