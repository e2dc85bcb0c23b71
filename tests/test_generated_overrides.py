"""Hostile input: generated override sets either run (synthetic data, 1 step) or end
with exit code 2 and one line on stderr; never a traceback, never a hang."""

import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lbt.apps.cli import main

KEYS = [
    "trainer.per_worker_batch", "trainer.global_batch", "trainer.epochs", "trainer.seed", "trainer.log_every",
    "trainer.threads", "trainer.checkpoint_every", "trainer.resume", "trainer.device", "trainer.progress",
    "dist.world_size", "dist.backend", "dist.timeout_s", "dist.fuse_workers", "dist.tensor_parallel",
    "dist.max_global_batch",
    "optim.lr", "optim.momentum", "data.num_train", "data.num_test", "data.num_classes", "data.val_fraction",
    "schedule.final_factor", "schedule.scaling", "schedule.warmup_epochs", "schedule.warmup_samples",
    "schedule.base_batch", "optim.no_bn_weight_decay", "dist.wrold_size", "trainer.epoch", "model.no_such_option",
]
GROUPS = {
    "model": ["mlp", "cnn1d", "resnet9000", "MLP"],
    "schedule": ["cosine", "poly", "step", "constant", "linear"],
    "optim": ["sgd", "lars", "lamb", "adam"],
    "recipe": ["baseline", "goyal2017", "lars", "lamb", "smith2017_ramp", "goyal"],
    "technique": ["[batch_ramp]", "[grad_clip,label_smoothing]", "[ghost_bn]", "[nope]", "[lars]", "[]"],
    "data": ["synthetic"],
}
VALUES = st.one_of(
    st.integers(min_value=-3, max_value=300),
    st.integers(min_value=-(10**12), max_value=10**12),
    st.floats(allow_nan=True, allow_infinity=True, width=32),
    st.booleans(),
    st.sampled_from(["abc", "null", "''", "[1,2]", "{a: 1}", "1e309", "-0", "auto", "gloo", "cuda", "0x10"]),
)


def format_value(value) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


override_sets = st.lists(
    st.one_of(
        st.tuples(st.sampled_from(KEYS), VALUES).map(lambda kv: f"{kv[0]}={format_value(kv[1])}"),
        st.sampled_from(sorted(GROUPS)).flatmap(lambda g: st.sampled_from(GROUPS[g]).map(lambda v: f"{g}={v}")),
        # process counts, mostly bad ones; real processes (procs=2) now and then, as they cost seconds
        st.sampled_from(["dist.procs=1", "dist.procs=0", "dist.procs=-1", "dist.procs=x", "dist.procs=1000000",
                         "dist.procs=3", "dist.procs=1.5", "dist.procs=null"] * 3 + ["dist.procs=2"]),
    ),
    max_size=5,
    unique_by=lambda o: o.split("=", 1)[0],
)


@settings(max_examples=30, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@pytest.mark.slow
@given(override_sets)
def test_generated_overrides_run_or_fail_in_one_line(tmp_path_factory, capfd, overrides):
    run_dir = tmp_path_factory.mktemp("hostile")
    args = ["train", "data=synthetic", *overrides, "trainer.max_steps=1", "trainer.progress=false",
            f"hydra.run.dir={run_dir}"]
    capfd.readouterr()  # what earlier examples wrote
    started = time.monotonic()
    code = 0
    try:
        main(args)
    except SystemExit as exit_:
        code = exit_.code
    assert time.monotonic() - started < 60
    # File-descriptor level: worker processes (dist.procs > 1) write to the terminal's stderr too.
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith(("lbt: note:", "lbt: warning:"))]
    assert "Traceback" not in err, err
    if code == 0:
        assert (run_dir / "result.json").exists() and lines == [], err
    else:
        assert code == 2, (code, err)
        assert len(lines) == 1 and lines[0].startswith("lbt: error:"), err
