"""Real gloo processes take the steps that simulated workers take: one matrix of models, techniques, world sizes
and process counts.

W workers run as P processes of W/P workers each. Every case below trains on real processes and is compared
with the same run simulated in this process (and, where the math says so, with W=1 at the same global batch):

- BN-free mlp: W=4 on 4 processes, on 2 processes of 2 workers and on 1 process equal W=1 at batch 64;
  cnn1d with BatchNorm: the three W=4 layouts agree and differ from W=1 (each worker normalises its own
  16 samples), fused and sequential;
- techniques: bf16, a stop at a val target, the auto batch ramp (transformer), gradient delay, local SGD
  (W=2 and W=4), the noise scale (against per-example gradients, and leaving the run bitwise alone), fp16/bf16
  gradient compression, Muon, a probe branch, the DDP timing hooks;
- data and models: a character model on a text file, GPT on token files;
- tensor parallelism: DP x T groups equal DP data-parallel workers, norms over split layers included.

Every real run of the matrix is trained on P processes started once per process count (`real`,
conftest.train_on_processes): each process trains the cases in turn, each in a process group of its own and in
its own run folder, as the launcher's workers train one run (tests/test_launchers.py, tests/test_resume.py and
tests/test_restarts.py start a job per run, through lbt's launcher and its command).
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path

import pytest
import torch
from conftest import FAST, compose_config, final_params, initial_params, relative_diff, train, train_on_processes
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from test_gns import exact_b_simple

from lbt.data.synthetic import build_synthetic
from lbt.data.tokens import write_byte_tokens
from lbt.engine import make_spec, run
from lbt.models import MLP

pytestmark = pytest.mark.slow  # every test here reads runs of real processes

# 1280 / 64 = 20 steps at global batch 64.
STEPS = ["data.num_train=1280", "trainer.epochs=1", "optim.lr=0.05"]
W4 = ["dist.world_size=4", "trainer.global_batch=64"]
# 6 steps of global batch 64 on a small BatchNorm-free MLP.
MLP_6 = ["model=mlp", "model.hidden=32", "data.num_train=384", "data.num_test=64", "trainer.epochs=1",
         "trainer.global_batch=64", "optim.lr=0.05", "trainer.evals=0"]
# 384 samples / global batch 64 = 6 steps of the BN-free mlp.
DELAY_RUN = ["model=mlp", "data.num_train=384", "trainer.epochs=1", "trainer.global_batch=64", "optim.lr=0.05",
             "trainer.evals=0"]
LOCAL_SGD = ["strategy=local_sgd", "strategy.period=3", "strategy.warmup_steps=2",
             "trainer.evals=2"]
TINY_TRANSFORMER = ["model=transformer1d", "model.dim=16", "model.heads=2", "model.depth=1"]
AUTO_RAMP = ["optim=adamw", "schedule=constant", "schedule.scaling=adam_sqrt", "optim.betas=[0.99,0.999]",
             "dist.world_size=2", "trainer.per_worker_batch=16", "trainer.epochs=3", "technique=[batch_ramp]",
             "technique.batch_ramp.mode=auto", "technique.batch_ramp.threshold=0.01",
             "technique.batch_ramp.max_global_batch=128", "technique.batch_ramp.grow=world_size", *TINY_TRANSFORMER]
# N=256 training samples, global batch 64 = N/4; a negligible LR keeps the parameters where the exact value is
# computed while the EMA averages many steps.
GNS_RUN = ["model=mlp", "data.num_train=256", "trainer.epochs=100", "optim.lr=1e-9", "optim.momentum=0",
           "optim.weight_decay=0", "schedule=constant", "technique=[gns]", "technique.gns.ema_decay=0.99",
           "technique.gns.every=1"]
GNS_LAYOUTS = {
    "real+simulated": ["dist.world_size=4", "dist.procs=2", "trainer.per_worker_batch=16"],
    "real": ["dist.world_size=2", "dist.procs=2", "trainer.per_worker_batch=32"],  # via the DDP comm hook
}
# cnn1d has BatchNorm: the layout of the passes over workers shows in its statistics.
MEASURED_RUN = ["model=cnn1d", "model.channels=16", "data.num_train=768", "trainer.epochs=2",
                "trainer.global_batch=128", "trainer.log_every=3"]
MEASURED_LAYOUTS = {"real": ["dist.world_size=2", "dist.procs=2"],
                    "real+simulated": ["dist.world_size=4", "dist.procs=2"]}
COMPRESSED = ["model=mlp", "data.num_train=1024", "trainer.epochs=1", "trainer.global_batch=64", "optim.lr=0.05",
              "technique=[comm_compression]", "dist.world_size=2"]
MUON = ["model=mlp", "optim=muon", "data.num_train=640", "trainer.epochs=1", "trainer.evals=0"]
MUON_W2 = ["dist.world_size=2", "trainer.global_batch=64"]
PROBE_BASE = ["model=mlp", "trainer.per_worker_batch=8", "trainer.epochs=4", "optim.lr=0.05"]  # 64 steps/epoch
SENTENCES = ["the cat sat on the mat. ", "a dog ran far away! ", "zebras are quick, jumpy? ",
             "we love large batches. ", "vexing fjords glow. "]
TEXT = ["data.context=16", "optim=adamw", "optim.lr=0.003", "trainer.progress=false", "trainer.device=cpu",
        "trainer.threads=1", "model.dim=32", "model.depth=1"]
TEXT_W2 = ["dist.world_size=2", "trainer.per_worker_batch=8", "trainer.max_steps=4"]
TOKENS = ["data=tokens", "data.context=16", "model.n_layer=1", "model.n_head=2", "model.n_embd=32", "optim=adamw",
          "optim.lr=0.003", "trainer.progress=false", "trainer.device=cpu", "trainer.threads=1",
          "trainer.loader_workers=0", "trainer.evals=2"]
TOKENS_W4 = ["dist.world_size=4", "trainer.per_worker_batch=4", "trainer.max_steps=3"]
TOKENS_TP = ["trainer.per_worker_batch=8", "trainer.max_steps=3"]
TP_MLP = ["model=mlp", "model.hidden=64", *STEPS, "trainer.per_worker_batch=64"]
TP_NORMS = ["model=transformer1d", "model.dim=16", "model.depth=1", "model.heads=2", "optim=lamb", "optim.lr=0.01",
            "technique=[grad_clip]", "technique.grad_clip.max_norm=0.1", "measure=[gns]", *STEPS[:2],
            "trainer.global_batch=64"]
TP_NORMS_SGD = [c for c in TP_NORMS if not c.startswith("optim")] + ["optim=sgd", "optim.lr=0.01"]
TP_CNN = ["model=cnn1d", "model.channels=16", *STEPS, "trainer.global_batch=64"]
STOP_RUN = ["model=mlp", *STEPS, "data.val_fraction=0.25", "trainer.epochs=2", "dist.world_size=2",
            "trainer.global_batch=64"]
# DDP takes one communication hook: compression and the noise-scale measurement compose into it with the
# timer, so the split is there whatever techniques hook the allreduce.
TIMED_HOOKS = {"allreduce": [], "fp16+gns": ["technique=[comm_compression]", "measure=[gns]"]}


def real_cases(inputs: dict) -> dict[str, list[str]]:
    """Each real run of the matrix: its whole override list, as compose_config takes it."""
    text = ["data=text", f"data.path={inputs['text_file']}", *TEXT]
    tokens = [*TOKENS, f"data.path={inputs['token_dir']}"]
    cases = {
        **{f"{model}_p4": FAST + [f"model={model}", *STEPS, *W4, "dist.procs=4"] for model in ("mlp", "cnn1d")},
        **{f"{model}_p2_{fuse}": FAST + [f"model={model}", *STEPS, *W4, "dist.procs=2", f"dist.fuse_workers={fuse}"]
           for model in ("mlp", "cnn1d") for fuse in ("true", "false")},
        "stop_at_target": FAST + STOP_RUN + ["dist.procs=2", inputs["stop"]],
        "bf16": FAST + MLP_6 + ["trainer.precision=bf16", "dist.world_size=2", "dist.procs=2"],
        "auto_ramp": FAST + AUTO_RAMP + ["dist.procs=2"],
        "gradient_delay": FAST + DELAY_RUN + ["strategy=gradient_delay", "strategy.delay=1",
                                              "dist.world_size=2", "dist.procs=2"],
        **{f"local_sgd_w{w}": FAST + DELAY_RUN + LOCAL_SGD + [f"dist.world_size={w}", f"dist.procs={w}"]
           for w in (2, 4)},
        **{f"gns_{name}": FAST + GNS_RUN + layout for name, layout in GNS_LAYOUTS.items()},
        **{f"measured_{name}_{measured}": FAST + MEASURED_RUN + layout + (["measure=[gns]"] if measured else [])
           for name, layout in MEASURED_LAYOUTS.items() for measured in (False, True)},
        **{f"compressed_{kind}": FAST + COMPRESSED + [f"technique.comm_compression.kind={kind}", "dist.procs=2"]
           for kind in ("fp16", "bf16")},
        "muon": FAST + MUON + MUON_W2 + ["dist.procs=2"],
        "probe_branch": FAST + PROBE_BASE + [f"trainer.branch_from={inputs['probe_base']}", "trainer.branch_at=256",
                                             "trainer.branch_samples=256", "trainer.evals=2", "dist.world_size=4",
                                             "dist.procs=2"],
        "text": text + TEXT_W2 + ["dist.procs=2"],
        "tokens_p4": tokens + TOKENS_W4 + ["dist.procs=4"],
        "tokens_tp": tokens + TOKENS_TP + ["dist.procs=2", "dist.world_size=2", "dist.tensor_parallel=2"],
        "tp_one_group": FAST + TP_MLP + ["dist.procs=2", "dist.world_size=2", "dist.tensor_parallel=2"],
        "tp_norms": FAST + TP_NORMS + ["dist.procs=2", "dist.world_size=8", "dist.tensor_parallel=2"],
        "tp_norms_sgd": FAST + TP_NORMS_SGD + ["dist.procs=2", "dist.world_size=8", "dist.tensor_parallel=2"],
        "tp_hybrid": FAST + TP_CNN + ["dist.procs=4", "dist.world_size=8", "dist.tensor_parallel=2"],
        "tp_data_parallel": FAST + TP_CNN + ["dist.procs=2", "dist.world_size=4"],
        **{f"timed_{name}": FAST + ["model=mlp", "trainer.epochs=1", "dist.world_size=2", "dist.procs=2",
                                    "trainer.log_every=2", *hooks] for name, hooks in TIMED_HOOKS.items()},
    }
    return cases


def run_overrides(run_dir: Path, overrides: list[str]) -> dict:
    """One in-process run of a whole override list (compose_config's): result.json's fields."""
    config, recipe = compose_config(overrides)
    return run(make_spec(config, recipe), run_dir).to_json()


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict:
    """What the real runs read: a text file, a token folder, a probe's base run, and a val target reached
    mid-run by the stop case (from the run trained whole, here)."""
    root = tmp_path_factory.mktemp("inputs")
    order = torch.randint(len(SENTENCES), (100,), generator=torch.Generator().manual_seed(0))
    (root / "corpus.txt").write_text("".join(SENTENCES[i] for i in order), encoding="utf-8")
    write_byte_tokens(str(root / "corpus.txt"), str(root / "tokens"))
    train(root / "probe_base", [*PROBE_BASE, "trainer.snapshot_samples=[256]"])
    whole = train(root / "whole", STOP_RUN + ["dist.procs=1"])
    history = whole["val_history"]
    # An evaluation before the last that is the first to reach its accuracy: the stop's.
    k = next(k for k, p in enumerate(history[:-1]) if k > 2 and all(q["acc"] < p["acc"] for q in history[:k]))
    return {"text_file": root / "corpus.txt", "token_dir": root / "tokens", "probe_base": root / "probe_base",
            "whole": whole, "stop_k": k, "stop": f"trainer.stop_at_val_acc={history[k]['acc']!r}"}


@pytest.fixture(scope="module")
def real(tmp_path_factory, inputs) -> dict[str, Path]:
    """Every case of the matrix trained on real processes (one start of P processes per P): its run folder."""
    root = tmp_path_factory.mktemp("real")
    by_procs: dict[int, list] = defaultdict(list)
    for name, overrides in real_cases(inputs).items():
        procs = next(int(o.split("=")[1]) for o in overrides if o.startswith("dist.procs="))
        by_procs[procs].append((root / name, overrides))
    for procs, jobs in sorted(by_procs.items()):
        train_on_processes(procs, jobs)
    return {run_dir.name: run_dir for jobs in by_procs.values() for run_dir, _ in jobs}


def result(run_dir: Path) -> dict:
    return json.loads((run_dir / "result.json").read_text())


# -- layouts: W=4 on 4, 2 and 1 processes, and W=1 ----------------------------------------------------
@pytest.fixture(scope="module")
def single(tmp_path_factory) -> dict[str, Path]:
    """W=1 with per_worker_batch 64, per model: the same global batch as the W=4 layouts."""
    root = tmp_path_factory.mktemp("single")
    for model in ("mlp", "cnn1d"):
        train(root / model, [f"model={model}", *STEPS, "dist.world_size=1", "trainer.per_worker_batch=64"])
    return {model: root / model for model in ("mlp", "cnn1d")}


def layouts(real: dict[str, Path], single: dict[str, Path], tmp_path: Path, model: str, fuse: bool):
    """Final parameters and results of P=4 x k=1, P=2 x k=2, P=1 x k=4 (all W=4), and W=1."""
    fuse_workers = f"dist.fuse_workers={str(fuse).lower()}"
    train(tmp_path / "sim", [f"model={model}", *STEPS, *W4, "dist.procs=1", fuse_workers])
    dirs = [real[f"{model}_p4"], real[f"{model}_p2_{str(fuse).lower()}"], tmp_path / "sim", single[model]]
    results = [result(d) for d in dirs]
    for r in results:
        assert r["steps"] == 20 and r["global_batch"] == 64
    assert [r["procs"] for r in results[:3]] == [4, 2, 1]
    return [final_params(d) for d in dirs], results


@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "sequential"])
def test_bn_free_model_is_identical_across_layouts(real, single, tmp_path, fuse):
    (four, two, one, w1), results = layouts(real, single, tmp_path, "mlp", fuse)
    assert relative_diff(four, one) < 1e-5
    assert relative_diff(four, w1) < 1e-5
    assert relative_diff(one, w1) < 1e-5
    assert relative_diff(two, four) < 1e-5
    assert relative_diff(two, one) < 1e-5
    # The runs really trained: the parameters moved from their (shared) initial values a
    # thousand times the tolerance above (5.4e-2 with torch 2.14).
    assert relative_diff(four, initial_params(["model=mlp", *STEPS])) > 1e-2
    assert results[0]["final_train_loss"] == pytest.approx(results[3]["final_train_loss"], rel=1e-4)


@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "sequential"])
def test_batchnorm_model_real_equals_simulated_but_not_single_worker(real, single, tmp_path, fuse):
    (four, two, one, w1), results = layouts(real, single, tmp_path, "cnn1d", fuse)
    assert relative_diff(four, one) < 1e-5
    assert relative_diff(four, two) < 1e-5
    # per-worker BN statistics over 16 samples are not those over 64 samples
    assert relative_diff(four, w1) > 1e-3
    # evaluation uses the workers' averaged running stats: the same in every W=4 layout
    for other in results[1:3]:
        assert results[0]["final_test_acc"] == pytest.approx(other["final_test_acc"], abs=1e-9)
        assert results[0]["final_test_loss"] == pytest.approx(other["final_test_loss"], rel=1e-4)


# -- techniques ---------------------------------------------------------------------------------------
def test_real_processes_stop_at_a_target_where_simulated_workers_do(real, inputs, tmp_path):
    """trainer.stop_at_val_acc reads the val split scored over every process (an allreduce), so a run's
    processes agree on the evaluation that ends it: W=2 on 2 processes ends where W=2 on 1 process does."""
    whole, k = inputs["whole"], inputs["stop_k"]
    history = whole["val_history"]
    stopped = result(real["stop_at_target"])
    simulated = train(tmp_path / "sim", STOP_RUN + ["dist.procs=1", inputs["stop"]])
    assert stopped["ended_at_target"] and simulated["ended_at_target"]
    assert stopped["steps"] == simulated["steps"] == history[k]["step"] < whole["steps"]
    assert stopped["final_val_acc"] == pytest.approx(simulated["final_val_acc"]) == history[k]["acc"]


def test_bf16_real_workers_equal_simulated_ones(real, tmp_path):
    simulated = train(tmp_path / "sim", MLP_6 + ["trainer.precision=bf16", "dist.world_size=2"])
    train(tmp_path / "fp32", MLP_6 + ["dist.world_size=2"])
    a, b, fp32 = final_params(real["bf16"]), final_params(tmp_path / "sim"), final_params(tmp_path / "fp32")
    # Within bf16's tolerance (8 bits of mantissa; equal on this CPU with torch 2.14, where fp32 layouts
    # differ by ~1e-11), and bf16 did run: 3.9e-4 from fp32 after these 6 steps.
    assert relative_diff(a, b) < 1e-3
    assert relative_diff(b, fp32) > 1e-5
    assert result(real["bf16"])["final_train_loss"] == pytest.approx(simulated["final_train_loss"], rel=1e-2)


def test_auto_ramp_simulated_equals_real_processes(real, tmp_path):
    # transformer1d (AdamW, the square-root rule) on 2 real processes and simulated: the same batch
    # decisions (worker 0's measurement) and the same parameters.
    simulated = train(tmp_path / "sim", AUTO_RAMP)
    decided = "batch_ramp/global_batch"
    assert result(real["auto_ramp"])["technique_curves"][decided] == simulated["technique_curves"][decided]
    assert relative_diff(final_params(tmp_path / "sim"), final_params(real["auto_ramp"])) < 2e-4  # float order


def test_delay_simulated_equals_real_and_differs_from_synchronous(real, tmp_path):
    delay = ["strategy=gradient_delay", "strategy.delay=1", "dist.world_size=2"]
    simulated = train(tmp_path / "sim", DELAY_RUN + delay)
    sync = train(tmp_path / "sync", DELAY_RUN + ["dist.world_size=2"])
    delayed = result(real["gradient_delay"])
    assert simulated["steps"] == delayed["steps"] == 6
    assert relative_diff(final_params(tmp_path / "sim"), final_params(real["gradient_delay"])) < 1e-5
    # The delay is real: 5 updates with stale gradients are not the synchronous run's 6.
    assert relative_diff(final_params(tmp_path / "sim"), final_params(tmp_path / "sync")) > 1e-3
    assert delayed["allreduces"] == sync["allreduces"] == 6  # double buffering hides, does not save, communication


@pytest.mark.parametrize("world_size", [2, 4])
def test_local_sgd_simulated_equals_real(real, tmp_path, world_size):
    simulated = train(tmp_path / "sim", DELAY_RUN + LOCAL_SGD + [f"dist.world_size={world_size}"])
    averaged = result(real[f"local_sgd_w{world_size}"])
    assert relative_diff(final_params(tmp_path / "sim"), final_params(real[f"local_sgd_w{world_size}"])) < 1e-5
    assert relative_diff(final_params(tmp_path / "sim"), initial_params(DELAY_RUN)) > 1e-2
    # Evaluations score the workers' average model: the same numbers.
    assert simulated["final_test_loss"] == pytest.approx(averaged["final_test_loss"], rel=1e-4)
    # 2 warm-up gradient allreduces + averages after steps 2 and 5 of 6.
    assert simulated["allreduces"] == averaged["allreduces"] == 4
    params = initial_params(DELAY_RUN).numel()
    assert averaged["bytes_sent"] == pytest.approx(4 * 2 * (world_size - 1) / world_size * 4 * params)


@pytest.mark.parametrize("layout", list(GNS_LAYOUTS))
def test_in_training_noise_scale_of_real_processes_matches_per_example_gradients(real, layout):
    """The simulated layouts are in tests/test_gns.py."""
    estimate = result(real[f"gns_{layout}"])["technique_metrics"]["gns/b_simple"]
    data = build_synthetic(num_train=256)
    model = MLP(input_shape=data.input_shape, num_classes=data.num_classes)
    model.load_state_dict(torch.load(real[f"gns_{layout}"] / "final_model.pt", weights_only=True))
    exact = exact_b_simple(model, data.train.x, data.train.y)
    assert math.isfinite(estimate)
    assert estimate == pytest.approx(exact, rel=0.25)


@pytest.mark.parametrize("layout", list(MEASURED_LAYOUTS))
def test_measuring_the_noise_scale_leaves_real_processes_bitwise_alone(real, layout):
    """The simulated layouts are in tests/test_measurement.py."""
    plain, measured = (real[f"measured_{layout}_{m}"] for m in (False, True))
    assert "gns/b_simple" in result(measured)["technique_metrics"]  # it did measure
    a, b = (torch.load(d / "final_model.pt", weights_only=True) for d in (plain, measured))
    assert not [k for k in a if not torch.equal(a[k], b[k])]
    assert result(plain)["test_history"] == result(measured)["test_history"]


@pytest.mark.parametrize("kind", ["fp16", "bf16"])
def test_simulated_compression_agrees_with_real_workers(real, kind, tmp_path):
    """Each simulated worker's gradient goes through the compression its GPU would apply."""
    compressed = COMPRESSED + [f"technique.comm_compression.kind={kind}"]
    train(tmp_path / "simulated", compressed + ["dist.procs=1"])
    train(tmp_path / "uncompressed", [o for o in compressed if "comm_compression" not in o])
    on_real, simulated = final_params(real[f"compressed_{kind}"]), final_params(tmp_path / "simulated")
    uncompressed = final_params(tmp_path / "uncompressed")
    rounding = {"fp16": 2**-11, "bf16": 2**-8}[kind]  # the 16-bit type's relative rounding
    gap = relative_diff(on_real, simulated)
    assert gap < 10 * rounding, gap  # 16 steps of 16-bit rounding, summed in a different order
    # not a no-op: compression moves both runs away from the uncompressed one, by far more than they differ
    # (here fp16: 3.5e-7 apart, 7.6e-6 from uncompressed; bf16: bitwise equal, 6.2e-5 from uncompressed)
    moved = relative_diff(uncompressed, simulated)
    assert moved > 1e-6 and moved > 5 * gap and relative_diff(uncompressed, on_real) > 1e-6
    compressed_run = result(real[f"compressed_{kind}"])
    assert any(kind in t for t in compressed_run["techniques"]) and math.isfinite(compressed_run["final_train_loss"])


def test_muon_real_processes_equal_simulated_workers(real, tmp_path):
    """BN-free mlp, W=2: two gloo processes, two simulated workers on one, and W=1 at batch 64."""
    train(tmp_path / "sim", MUON + MUON_W2 + ["dist.procs=1"])
    train(tmp_path / "single", MUON + ["dist.world_size=1", "trainer.per_worker_batch=64"])
    on_real = result(real["muon"])
    assert on_real["steps"] == 10 and on_real["procs"] == 2
    a, b, c = final_params(real["muon"]), final_params(tmp_path / "sim"), final_params(tmp_path / "single")
    assert relative_diff(a, b) < 1e-5 and relative_diff(a, c) < 1e-5


def test_probe_branch_on_simulated_workers_equals_real_processes(real, inputs, tmp_path):
    base = inputs["probe_base"]
    train(tmp_path / "sim", [*PROBE_BASE, f"trainer.branch_from={base}", "trainer.branch_at=256",
                             "trainer.branch_samples=256", "trainer.evals=2", "dist.world_size=4", "dist.procs=1"])
    branched = result(tmp_path / "sim")
    assert branched["samples_seen"] == 512 and not branched["diverged"]
    assert relative_diff(final_params(tmp_path / "sim"), final_params(real["probe_branch"])) < 1e-5
    assert relative_diff(final_params(tmp_path / "sim"), final_params(base)) > 1e-3  # it trained: not the base's end


@pytest.mark.parametrize("hooks", list(TIMED_HOOKS))
def test_step_time_split_for_real_processes(real, hooks):
    timed = result(real[f"timed_{hooks}"])
    if TIMED_HOOKS[hooks]:
        assert any("fp16" in t for t in timed["techniques"]) and "gns/b_simple" in timed["technique_metrics"]
    assert set(timed["step_seconds"]) == {"data_s", "compute_s", "comm_s", "optimizer_s"}
    assert all(v > 0 for v in timed["step_seconds"].values())
    events = EventAccumulator(str(real[f"timed_{hooks}"]))
    events.Reload()
    expected = ("perf/data_s", "perf/compute_s", "perf/comm_s", "perf/optimizer_s")
    for tag in expected + ("gns/b_simple",) * bool(TIMED_HOOKS[hooks]):
        assert tag in events.Tags()["scalars"]


# -- data and models ------------------------------------------------------------------------------------
def test_two_real_workers_equal_two_simulated_on_text(real, inputs, tmp_path):
    """No BatchNorm: W=2 on 2 processes and W=2 simulated on 1 take the same steps."""
    simulated = run_overrides(tmp_path / "sim", ["data=text", f"data.path={inputs['text_file']}", *TEXT, *TEXT_W2,
                                                 "dist.procs=1"])
    on_real = result(real["text"])
    assert (on_real["procs"], simulated["procs"], on_real["steps"], simulated["steps"]) == (2, 1, 4, 4)
    assert relative_diff(final_params(real["text"]), final_params(tmp_path / "sim")) < 1e-5
    assert on_real["final_val_loss"] == pytest.approx(simulated["final_val_loss"], rel=1e-5)


def test_four_real_workers_equal_four_simulated_on_tokens(real, inputs, tmp_path):
    tokens = [*TOKENS, f"data.path={inputs['token_dir']}"]
    simulated = run_overrides(tmp_path / "sim", tokens + TOKENS_W4 + ["dist.procs=1"])
    on_real = result(real["tokens_p4"])
    assert (on_real["procs"], simulated["procs"], on_real["steps"]) == (4, 1, 3)
    assert relative_diff(final_params(real["tokens_p4"]), final_params(tmp_path / "sim")) < 1e-5
    assert on_real["final_val_loss"] == pytest.approx(simulated["final_val_loss"], rel=1e-5)


def test_tensor_parallel_gpt_equals_the_unsplit_one(real, inputs, tmp_path):
    tokens = [*TOKENS, f"data.path={inputs['token_dir']}"]
    single_run = run_overrides(tmp_path / "one", tokens + TOKENS_TP + ["dist.procs=1", "dist.world_size=1"])
    split = result(real["tokens_tp"])
    assert (split["tensor_parallel"], split["global_batch"], split["steps"]) == (2, 8, 3)
    assert relative_diff(final_params(tmp_path / "one"), final_params(real["tokens_tp"])) < 1e-5
    assert split["final_val_loss"] == pytest.approx(single_run["final_val_loss"], rel=1e-5)


# -- tensor parallelism ---------------------------------------------------------------------------------
def test_one_group_of_two_equals_one_process(real, tmp_path):
    """DP=1 x T=2 on 2 processes = 1 process at the same global batch (BN-free mlp)."""
    single_run = train(tmp_path / "one", TP_MLP + ["dist.procs=1", "dist.world_size=1"])
    split = result(real["tp_one_group"])
    assert (split["global_batch"], split["world_size"], split["tensor_parallel"], split["steps"]) == (64, 2, 2, 20)
    assert relative_diff(final_params(tmp_path / "one"), final_params(real["tp_one_group"])) < 1e-5
    assert split["final_train_loss"] == pytest.approx(single_run["final_train_loss"], rel=1e-5)
    assert split["final_test_acc"] == pytest.approx(single_run["final_test_acc"], abs=1e-9)


def test_norms_over_split_layers_count_every_shard(real, tmp_path):
    """A transformer whose blocks' attention (by heads) and MLPs are split, trained by LAMB with gradient clipping
    (each rank clips by the whole gradient's norm: the shards' norms summed over the group with the replicated
    ones'), and the noise scale measured over 4 simulated workers (with SGD, whose step it is defined for):
    the split run equals the unsplit one."""
    train(tmp_path / "one", TP_NORMS + ["dist.procs=1", "dist.world_size=4"])
    assert relative_diff(final_params(tmp_path / "one"), final_params(real["tp_norms"])) < 1e-5
    # B_simple is only a critical batch for SGD's step: result.json leaves LAMB's out and says why.
    split = result(real["tp_norms"])
    assert "gns/b_simple" not in split["technique_metrics"] and any("not defined for LAMB" in t
                                                                    for t in split["techniques"])
    single_sgd = train(tmp_path / "one_sgd", TP_NORMS_SGD + ["dist.procs=1", "dist.world_size=4"])
    assert result(real["tp_norms_sgd"])["technique_metrics"]["gns/b_simple"] == pytest.approx(
        single_sgd["technique_metrics"]["gns/b_simple"], rel=1e-4)


def test_two_groups_of_two_equal_two_data_parallel_workers(real):
    """DP=2 x T=2 on 4 processes = DP=2 on 2 processes: cnn1d, whose convolutions (and per-worker
    BatchNorm) are replicated in a group and whose head is split; each group simulates 2 workers."""
    hybrid, data_parallel = result(real["tp_hybrid"]), result(real["tp_data_parallel"])
    assert (hybrid["data_parallel"], hybrid["global_batch"]) == (4, 64)
    assert relative_diff(final_params(real["tp_data_parallel"]), final_params(real["tp_hybrid"])) < 1e-5
    assert hybrid["final_test_acc"] == pytest.approx(data_parallel["final_test_acc"], abs=1e-9)
