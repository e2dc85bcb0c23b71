"""A probe beside the study: `lbt probe ... probe.dir=<study>/<name>` of the same workload. The report puts
its prediction next to what the study measured, and their ratio: how far the cheap answer was off here."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from lbt.apps.report.jobs import PROBE_MARK, Job

# What makes a probe's base run the same workload as a study's runs (the world size and seed aside).
SAME = ("model", "data", "optim", "schedule")


def workload(config: dict[str, Any]) -> tuple:
    trainer = config.get("trainer", {})
    return (*(json.dumps(config.get(k), sort_keys=True) for k in SAME), trainer.get("epochs"),
            trainer.get("per_worker_batch"))


def probe_beside(study_dir: Path, jobs: list[Job], answer: dict[str, Any]) -> dict[str, Any] | None:
    """The first probe folder in the study whose base run trains the study's workload, with the study's
    measured largest batch for the probe's recipe; None when there is none (or no answer to hold it to)."""
    measured = {r["recipe"]: r["global_batch"] for r in answer.get("recipes", []) if r.get("global_batch")}
    for mark in sorted(study_dir.rglob(PROBE_MARK)):
        try:
            probe = json.loads((mark.parent / "probe.json").read_text())
            base = json.loads((mark.parent / "base" / "result.json").read_text())
        except (OSError, ValueError):
            continue
        same = [j for j in jobs if j.readable and j.result.recipe == base.get("recipe")
                and workload(j.result.config) == workload(base.get("config", {}))]
        batch = measured.get(base.get("recipe"))
        if not same or batch is None or not isinstance(probe.get("answer"), dict):
            continue
        predicted = probe["answer"]["largest_batch"]
        return {"folder": str(mark.parent.relative_to(study_dir)), "recipe": base["recipe"], "predicted": predicted,
                "interval": probe["answer"].get("interval"), "measured": batch, "ratio": predicted / batch,
                "confirmed": (probe.get("confirm") or {}).get("largest_batch")}
    return None


def probe_lines(found: dict[str, Any] | None) -> list[str]:
    if found is None:
        return []
    low, high = found["interval"] or (found["predicted"], found["predicted"])
    held = "inside" if low <= found["measured"] <= high else "outside"
    return ["", "## The probe beside this study", "",
            f"`lbt probe` in {found['folder']}/ ({found['recipe']}) predicted up to global batch "
            f"{found['predicted']:,} (interval {low:,}..{high:,}); this study measured {found['measured']:,}: "
            f"predicted / measured = {found['ratio']:.2f}, the measured answer {held} the interval."]
