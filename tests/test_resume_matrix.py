"""Every recipe and every stateful technique resumes exactly.

For each case: one run trained straight through; one run stopped in the middle
of an epoch by a real SIGTERM (sent by a test-only technique at a chosen step,
the signal SLURM sends on preemption) and continued with trainer.resume=auto in
the same run folder. Both must end with bitwise equal parameters and the same
steps, validation history and losses. Runs are in-process (tiny data, a few
epochs), except the cases on two real processes (PowerSGD's per-rank error feedback,
the delay's allreduces in flight, each rank's local model, tensor parallelism): those
train each phase (straight, stopped, resumed) of every such case on two processes
started once (`real_phases`, conftest.train_on_processes).
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from conftest import FAST, one_gloo_process, train, train_on_processes

from lbt.apps.compose import conf_dir
from lbt.techniques import Technique

# The recipe group, globbed so a new recipe joins the matrix.
RECIPES = sorted(path.stem for path in (conf_dir() / "recipe").glob("*.yaml"))

# 768 samples / global batch 64 = 12 steps per epoch, 3 epochs; two simulated
# workers (per-worker BN chunks, and a small batch for GNS to compare with).
RUN = ["model=cnn1d", "model.channels=16", "data.num_train=768", "trainer.epochs=3", "trainer.global_batch=64",
       "dist.world_size=2", "trainer.log_every=2", "trainer.checkpoint_every=0"]
STOP_AT = 16  # SIGTERM during step 17 (epoch 2); the loop stops at the next log step, 18
# Technique cases: overrides and the step that gets the SIGTERM.
TECHNIQUES = {
    "lars": (["optim=lars"], STOP_AT),
    "lamb": (["optim=lamb"], STOP_AT),
    # Muon, schedule-free AdamW and WSD resume as recipe=muon, schedulefree and wsd_adamw (the recipes below);
    # SOAP's preconditioner (eigenbases, refreshed every 10 steps: at step 10 and after the resume at 20)
    # under WSD's cooldown (the last 20%: steps 29-36); schedule-free SGD's average and iterate, checkpointed
    # in train mode, evaluated in eval mode (lbt/engine/evaluate.py).
    "soap_wsd": (["optim=soap", "schedule=wsd"], STOP_AT),
    "schedulefree_sgd": (["optim=schedulefree_sgd", "schedule=constant"], STOP_AT),
    # Milestones inside the run: epochs of 12, 6 and 3 steps at batch 64, 128, 256;
    # stopped at step 16, in the ramped second epoch.
    "batch_ramp": (["technique=[batch_ramp]", "technique.batch_ramp.milestones=[1,2]"], 14),
    # Batch-size warmup from the noise scale: a low threshold so the first epoch's end doubles the batch
    # (capped at 128: epochs of 12, 6 and 6 steps); stopped at step 14, in the ramped second epoch.
    "batch_ramp_auto": (["technique=[batch_ramp]", "technique.batch_ramp.mode=auto",
                         "technique.batch_ramp.threshold=0.01",
                         "technique.batch_ramp.max_global_batch=128", "optim=adamw", "schedule.scaling=adam_sqrt",
                         "optim.betas=[0.99,0.999]"], 14),
    "bn_epoch_average": (["technique=[bn_epoch_average]"], STOP_AT),
    "gns": (["measure=[gns]"], STOP_AT),
    # The pending averaged gradients (two real processes: their allreduces in flight at the signal).
    "gradient_delay": (["strategy=gradient_delay", "strategy.delay=2"], STOP_AT),
    "gradient_delay_real": (["strategy=gradient_delay", "dist.procs=2"], STOP_AT),
    # Each worker's own model (BN statistics included) and optimizer state; real: per rank, and the averager's step.
    "local_sgd": (["strategy=local_sgd", "strategy.warmup_steps=4"], STOP_AT),
    "local_sgd_real": (["strategy=local_sgd", "strategy.warmup_steps=4", "dist.procs=2"], STOP_AT),
    # Tensor parallelism (2 processes splitting the head, 2 simulated data-parallel workers): checkpoints
    # hold whole tensors, LARS's momentum included, and are split again on resume.
    "tensor_parallel": (["dist.procs=2", "dist.world_size=4", "dist.tensor_parallel=2", "optim=lars"], STOP_AT),
    # Two real processes: each rank's error feedback is its own.
    "powersgd": (["technique=[comm_compression]", "technique.comm_compression.kind=powersgd", "dist.procs=2"],
                 STOP_AT),
}
# torch's powerSGD_hook fails on CPU gradients where CUDA is present, and lbt refuses that run in one line
# (tests/test_techniques_model.py checks the refusal): these CPU tests of PowerSGD run on machines without CUDA.
POWERSGD_ON_CPU = pytest.mark.skipif(torch.cuda.is_available(), reason="PowerSGD on CPU beside CUDA is refused")
# Recipes that grow the batch from the noise scale: capped at 128 (epochs of 12, 6, 6 steps), stopped at 14.
RAMPED = {"batch_warmup": (["technique.batch_ramp.max_global_batch=128"], 14),
          "batch_warmup_adamw": (["technique.batch_ramp.max_global_batch=128"], 14)}
CASES = {f"recipe={name}": ([f"recipe={name}", *RAMPED.get(name, ([], 0))[0]], RAMPED.get(name, ([], STOP_AT))[1])
         for name in RECIPES} | TECHNIQUES
# Synthetic data holds out no validation split: the runs evaluate test (log-spaced and at epoch ends).
COMPARED = ("steps", "samples_seen", "test_history", "final_train_loss", "final_test_loss", "final_test_acc",
            "best_test_acc", "test_loss", "test_acc", "technique_metrics", "technique_curves")


class SigtermAt(Technique):
    """Test-only: rank 0 sends itself SIGTERM once, during the optimizer step `step` (counted from 0)."""

    name = "sigterm"

    def __init__(self, step: int):
        self.step, self.sent = step, False

    def after_backward(self, model, progress) -> None:
        rank0 = not dist.is_initialized() or dist.get_rank() == 0
        if progress.step == self.step and rank0 and not self.sent:
            self.sent = True
            os.kill(os.getpid(), signal.SIGTERM)


def sigterm_at(step: int) -> list[str]:
    # Importable by name in spawned workers too: they inherit the test process's sys.path.
    return [f"+technique.sigterm._target_={__name__}.SigtermAt", f"+technique.sigterm.step={step}"]


def on_real_processes(case: str) -> bool:
    return "dist.procs=2" in CASES[case][0]


# The epoch-end case: a checkpoint every epoch, a stop read at the epoch's last step (during step 12).
EPOCH_END = (["dist.procs=2", "trainer.checkpoint_every=1"], 11)


@pytest.fixture(scope="module")
def real_phases(tmp_path_factory) -> Path:
    """Every real-process case (and EPOCH_END) trained straight, stopped by its SIGTERM, and resumed: each phase of
    all the cases on the same two processes. A folder per case: straight/ and run/ (stopped, then resumed)."""
    root = tmp_path_factory.mktemp("real")
    cases = {name: CASES[name] for name in CASES if on_real_processes(name)
             and not (name == "powersgd" and torch.cuda.is_available())} | {"epoch_end": EPOCH_END}
    stopped = {name: FAST + RUN + overrides + sigterm_at(stop_at) for name, (overrides, stop_at) in cases.items()}
    # The straight runs and the stopped ones on one start of the two processes (a stop ends its run, not them).
    train_on_processes(2, [(root / name / "straight", FAST + RUN + overrides) for name, (overrides, _) in cases.items()]
                       + [(root / name / "run", args) for name, args in stopped.items()])
    for name in cases:  # what the stop left, before the resume adds to it
        (root / name / "stopped.log").write_text((root / name / "run" / "train.log").read_text())
        (root / name / "stopped.json").write_text((root / name / "run" / "checkpoint" / "latest.json").read_text())
        (root / name / "stopped_result").write_text(str((root / name / "run" / "result.json").exists()))
    train_on_processes(2, [(root / name / "run", args + ["trainer.resume=auto"]) for name, args in stopped.items()])
    return root


def assert_resumed_exactly(straight_dir: Path, run_dir: Path, straight: dict, resumed: dict) -> None:
    a = torch.load(straight_dir / "final_model.pt", weights_only=True)
    b = torch.load(run_dir / "final_model.pt", weights_only=True)
    assert a.keys() == b.keys()
    assert not [k for k in a if not torch.equal(a[k], b[k])], "tensors differ after resume"
    for key in COMPARED:
        assert resumed[key] == straight[key], key


def stop_checkpoint(meta: dict, run_dir: Path) -> dict:
    """The loop state in the checkpoint the stop wrote (latest.json's `meta`)."""
    return torch.load(run_dir / "checkpoint" / meta["folder"] / "rank0.pt", weights_only=True)["loop"]


@pytest.mark.slow
@pytest.mark.parametrize("case", [pytest.param(c, marks=POWERSGD_ON_CPU) if c == "powersgd" else c for c in CASES])
def test_stopped_by_sigterm_mid_epoch_then_resumed_equals_straight_run(case, tmp_path, capfd, request):
    overrides, stop_at = CASES[case]
    if on_real_processes(case):
        folder = request.getfixturevalue("real_phases") / case
        straight_dir, run_dir = folder / "straight", folder / "run"
        straight = json.loads((straight_dir / "result.json").read_text())
        stopped_log, meta = (folder / "stopped.log").read_text(), json.loads((folder / "stopped.json").read_text())
        assert (folder / "stopped_result").read_text() == "False" and "stopped at step" in stopped_log
        resumed = json.loads((run_dir / "result.json").read_text())
        resumed_log = (run_dir / "train.log").read_text()[len(stopped_log):]
    else:
        args = RUN + overrides
        straight_dir, run_dir = tmp_path / "straight", tmp_path / "run"
        straight = train(straight_dir, args)
        stopped = train(run_dir, args + sigterm_at(stop_at))
        out = capfd.readouterr().out
        assert stopped["stopped"] and "stopped at step" in out
        assert not (run_dir / "result.json").exists()
        meta = json.loads((run_dir / "checkpoint" / "latest.json").read_text())
        resumed = train(run_dir, args + sigterm_at(stop_at) + ["trainer.resume=auto"])
        resumed_log = capfd.readouterr().out
    assert not straight["diverged"] and straight["steps"] > stop_at + 2
    assert meta["step"] > stop_at and stop_checkpoint(meta, run_dir)["step_in_epoch"] > 0  # really mid-epoch
    assert f"resumed from step {meta['step']} " in resumed_log  # from the checkpoint, not from scratch
    assert_resumed_exactly(straight_dir, run_dir, straight, resumed)


@pytest.mark.slow
def test_a_stop_at_an_epochs_end_after_its_checkpoint_stops_cleanly_and_resumes_exactly(real_phases):
    """Two processes, a checkpoint every epoch, a stop read at the epoch's last step: the epoch's checkpoint
    and the stop's are written one after the other at the same step. Rank 1 must not write the second
    while rank 0 still publishes the first and clears unfinished folders (else it loses its file: ENOENT)."""
    folder = real_phases / "epoch_end"
    stopped_log = (folder / "stopped.log").read_text()
    assert (folder / "stopped_result").read_text() == "False"
    assert "stopped at step 12 (epoch 2, step 0 of it)" in stopped_log
    assert "resumed from step 12 " in (folder / "run" / "train.log").read_text()[len(stopped_log):]
    straight, resumed = (json.loads((folder / d / "result.json").read_text()) for d in ("straight", "run"))
    assert_resumed_exactly(folder / "straight", folder / "run", straight, resumed)


@POWERSGD_ON_CPU
def test_powersgd_state_round_trips_through_a_weights_only_checkpoint(tmp_path):
    """Each rank's error feedback, warm-start P/Q, step count and numpy RNG: saved as copies, loaded back."""
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState

    from lbt.techniques.comm_compression import CommCompression

    def with_state() -> CommCompression:
        technique = CommCompression("powersgd")
        technique.comm_hook(None, SimpleNamespace(module=torch.nn.Linear(8, 4)))  # DDP: only .module is read
        return technique

    saved = with_state()
    state = saved.powersgd_state
    assert isinstance(state, PowerSGDState)
    state.iter, state.total_numel_before_compression = 7, 123
    state.error_dict[0] = torch.randn(5)
    state.p_memory_dict[0], state.q_memory_dict[0] = torch.randn(3), torch.randn(4)
    state.rng.randint(1000, size=10)  # move the RNG away from its seed
    saved.layouts = {0: [1, 0]}  # the bucket's parameters, last one first
    torch.save(saved.state_dict(), tmp_path / "state.pt")
    live = (state.error_dict[0], state.p_memory_dict[0], state.q_memory_dict[0])
    expected = [t.clone() for t in live]
    for t in live:
        t.add_(1.0)  # live tensors change after the save (the hook updates P and Q in place)
    next_draw = state.rng.randint(1_000_000_000)

    loaded = with_state()
    loaded.load_state_dict(torch.load(tmp_path / "state.pt", weights_only=True))
    other = loaded.powersgd_state
    assert other.iter == 7 and other.total_numel_before_compression == 123
    for t, e in zip((other.error_dict[0], other.p_memory_dict[0], other.q_memory_dict[0]), expected):
        assert torch.equal(t, e)
    assert other.rng.randint(1_000_000_000) == next_draw
    assert loaded.resumed_layouts == {0: [1, 0]}
    assert CommCompression("fp16").state_dict() == {}  # nothing to keep without PowerSGD


@POWERSGD_ON_CPU
def test_first_powersgd_step_after_resume_reduces_as_the_checkpointed_buckets(tmp_path):
    """A fresh DDP reduces every gradient as one bucket in its first step, then rebuilds its buckets
    (here into two); the resumed run's first step must still use the state of the checkpointed buckets.
    Hook calls on stand-in buckets in one gloo process: the allreduce is the identity, the compression not."""
    from lbt.techniques.comm_compression import CommCompression, _Bucket

    class Bucket(_Bucket):  # as DDP's: also names its parameters
        def __init__(self, index, last, grads, params):
            super().__init__(index, last, grads)
            self._params = params

        def parameters(self):
            return self._params

    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Linear(8, 5))
    params = list(model.parameters())
    generator = torch.Generator().manual_seed(0)
    grads = [[torch.randn(p.shape, generator=generator) for p in params] for _ in range(6)]
    first, rebuilt = {0: [0, 1, 2, 3]}, {0: [3, 2], 1: [1, 0]}

    def reduce(hook, number: int) -> list[torch.Tensor]:
        """Step `number`'s gradients through the hook, bucket by bucket as DDP lays them out then."""
        layouts, reduced = (first if number in (0, resumed_at) else rebuilt), {}
        for index, layout in layouts.items():
            bucket = Bucket(index, index == max(layouts), [grads[number][i].clone() for i in layout],
                            [params[i] for i in layout])
            reduced.update(zip(layout, bucket.views(hook(bucket).wait())))
        return [reduced[i] for i in range(len(params))]

    def hooked():
        technique = CommCompression("powersgd")
        return technique, technique.comm_hook(None, SimpleNamespace(module=model))

    def check() -> None:
        nonlocal resumed_at
        _, hook = hooked()
        expected = [reduce(hook, n) for n in range(6)]
        stopped, hook = hooked()
        for n in range(3):  # PowerSGD compresses from step 2 on
            reduce(hook, n)
        torch.save(stopped.state_dict(), tmp_path / "state.pt")
        resumed, hook = hooked()
        resumed.load_state_dict(torch.load(tmp_path / "state.pt", weights_only=True))
        resumed_at = 3
        for n in range(3, 6):
            assert all(torch.equal(a, b) for a, b in zip(reduce(hook, n), expected[n])), n
        assert not torch.equal(expected[3][2], grads[3][2])  # the (5, 8) weight went through compression

    resumed_at = None
    with one_gloo_process():
        check()
