"""The study report leads with one critical-batch figure, and no line of its accuracy plot contradicts its points."""

from __future__ import annotations

import json

from lbt.apps.report import write_report


def job(folder, recipe: str, world_size: int, acc: float, b_simple: float, optimizer: str) -> None:
    """A job folder as `lbt train -m` leaves it (its result.json, the trainer's fields)."""
    folder.mkdir(parents=True)
    batch = 64 * world_size
    steps = 10 * 8192 // batch
    history = [{"step": steps * (e + 1) // 2, "samples_seen": 40_960 * (e + 1), "global_batch": batch,
                "acc": acc - 0.05 * (1 - e), "loss": 1.0} for e in range(2)]
    (folder / "result.json").write_text(json.dumps({
        "recipe": recipe, "world_size": world_size, "procs": 1, "per_worker_batch": 64, "global_batch": batch,
        "seed": 0, "eval_split": "val", "final_val_acc": acc, "best_val_acc": acc, "test_acc": acc, "steps": steps,
        "samples_per_sec": 1000.0, "diverged": False, "val_history": history,
        "config": {"optim": {"optimizer_class": optimizer}},
        "technique_curves": {"gns/b_simple": [[40_960, b_simple], [81_920, b_simple]]},
    }))


def test_the_report_leads_with_the_sweeps_critical_batch_and_draws_only_it(tmp_path):
    # baseline holds within 1 point up to 1,024 and loses 5 points at 4,096; lars holds to 4,096.
    accs = {("baseline", 1): 0.98, ("baseline", 16): 0.975, ("baseline", 64): 0.93, ("lars", 1): 0.98,
            ("lars", 16): 0.979, ("lars", 64): 0.972, ("lars", 128): 0.90}
    for n, ((recipe, world_size), acc) in enumerate(accs.items()):
        optimizer = "torch.optim.SGD" if recipe == "baseline" else "lbt.optim.LARS"
        job(tmp_path / str(n), recipe, world_size, acc, b_simple=158.0, optimizer=optimizer)
    summary = write_report(tmp_path)
    crit = json.loads((tmp_path / "summary.json").read_text())["critical_batch"]
    assert crit == summary["critical_batch"]
    assert (crit["value"], crit["recipe"], crit["failed"]) == (4096, "lars", 8192)
    lines = (tmp_path / "report.md").read_text().splitlines()
    assert lines[2].startswith("**Critical batch: 4,096** (global batch, lars)")
    assert "between 4,096 and 8,192" in lines[2]
    assert sum("**Critical batch" in line for line in lines) == 1  # one figure; the others are diagnostics
    # The plot's vertical lines: only the lead figure, which the points agree with (every batch up to it held).
    drawn = summary["plot_lines"]["accuracy_vs_batch.png"]
    assert drawn == [4096.0]
    held = [batch for (recipe, w), acc in accs.items() if recipe == "lars" and 0.98 - acc <= 0.01
            for batch in [64 * w]]
    assert max(held) == drawn[0]
    assert 158.0 not in drawn  # B_simple, far below where every recipe still holds, is not drawn


def test_b_simple_is_not_defined_for_an_optimizer_whose_step_is_not_the_gradient(tmp_path):
    for n, (world_size, acc) in enumerate(((1, 0.98), (16, 0.978), (64, 0.95))):
        job(tmp_path / str(n), "lars", world_size, acc, b_simple=500.0, optimizer="lbt.optim.LARS")
    summary = write_report(tmp_path)
    crit = summary["critical_batch"]
    assert crit["gns"] is None and crit["gns_note"].startswith("not defined for LARS")
    assert "not defined for LARS" in (tmp_path / "report.md").read_text()
