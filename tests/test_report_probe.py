"""`lbt report` on a study folder that holds an `lbt probe` folder of the same workload: the probe's
prediction beside the study's measured answer, and the probe's runs kept out of the study's jobs."""

from __future__ import annotations

import json

from test_cli_errors import run_main_io
from test_study import _job

CONFIG = {"model": {"_target_": "lbt.models.MLP"}, "data": {"_target_": "lbt.data.build_mnist1d"},
          "optim": {"lr": 0.1}, "schedule": {"scaling": "linear"}, "trainer": {"epochs": 2, "per_worker_batch": 32}}


def study_with_a_probe(tmp_path, config_of_probe: dict) -> None:
    for n, (world_size, accs) in enumerate([(1, [0.8, 0.95]), (1, [0.8, 0.95]), (4, [0.7, 0.945]),
                                            (4, [0.7, 0.945]), (16, [0.5, 0.90]), (16, [0.5, 0.90])]):
        _job(tmp_path / str(n), "baseline", world_size, n % 2, accs, b_simple=200.0, test=accs[-1])
        result = tmp_path / str(n) / "result.json"
        result.write_text(json.dumps({**json.loads(result.read_text()), "config": CONFIG}))
    probe = tmp_path / "probe"
    _job(probe / "base", "baseline", 1, 0, [0.8, 0.95], b_simple=200.0, test=0.95)
    base = probe / "base" / "result.json"
    base.write_text(json.dumps({**json.loads(base.read_text()), "config": config_of_probe}))
    _job(probe / "branches" / "hold_at1024_w16_seed0", "baseline", 16, 0, [0.1], b_simple=1.0, test=0.1)
    (probe / "probe_command.json").write_text("{}")
    (probe / "probe.json").write_text(json.dumps({"answer": {"largest_batch": 256, "interval": [64, 512]}}))


def test_report_puts_the_probes_prediction_beside_the_measured_answer(tmp_path, capfd):
    study_with_a_probe(tmp_path, CONFIG)
    code, out, err = run_main_io(["report", str(tmp_path)], capfd)
    assert code == 0, err
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert len(summary["jobs"]) == 6  # the probe's base run and branch are not the study's jobs
    assert summary["gpu_answer"]["best"]["global_batch"] == 128
    assert summary["probe"] == {"folder": "probe", "recipe": "baseline", "predicted": 256, "interval": [64, 512],
                                "measured": 128, "ratio": 2.0, "confirmed": None}
    assert "predicted / measured = 2.00, the measured answer inside the interval" in out


def test_a_probe_of_another_workload_is_not_compared(tmp_path, capfd):
    study_with_a_probe(tmp_path, {**CONFIG, "model": {"_target_": "lbt.models.CNN1d"}})
    code, out, _ = run_main_io(["report", str(tmp_path)], capfd)
    assert code == 0 and "probe beside" not in out
    assert json.loads((tmp_path / "summary.json").read_text())["probe"] is None
