"""lbt on a CUDA GPU: its speed against a plain PyTorch loop, simulated workers, and the step split.

    python bench/gpu.py              # 3 interleaved repeats per figure
    python bench/gpu.py --quick      # 1 repeat, fewer steps
    python bench/gpu.py --models resnet20
    python bench/gpu.py --variant dist.fuse_workers=false --variant trainer.channels_last=false   # where W=8 loses
    python bench/gpu.py --all        # one command, about 8 minutes on one H200: see below
    python bench/gpu.py --all --device cpu --gpu-preset h200   # its dry run on a CPU (small cases, no suite)

Every run trains in bf16 autocast (`trainer.precision=bf16`) with channels_last inputs and model, on
synthetic data held on the GPU, SGD with momentum, world_size 1 unless said:
(a) lbt vs plain: `lbt.engine.run` (its real path: LR per step, loss bookkeeping, TensorBoard, CUDA-event
    step timer) against a hand-written loop on the same model, the same on-GPU data gathered by
    index_select, the same autocast and layout; samples/s of the training steps (the plain loop
    synchronises once at its end; lbt's figure excludes evaluation). Target: lbt / plain >= 0.97.
(b) simulated W=8 on one GPU vs W=1 at the same global batch (per-worker batch / 8, fused workers with
    per-worker BatchNorm). Target: >= 0.9.
(c) the step split lbt measures (data, compute, optimizer seconds per step, CUDA events).
Models: resnet20 on CIFAR-sized 3x32x32 inputs, torchvision resnet50 on 3x224x224 inputs.
Each --variant OVERRIDE runs W=1 and W=8 again with that override added and prints their ratio beside (b)'s.
On a machine without CUDA it prints one line and exits 0. The last line is `gpu_ratio=<worst lbt/plain>`.

--all, within --budget seconds (470): (a) for resnet20 and resnet50, lbt / plain and W=8 / W=1 (2 interleaved
repeats), each with the BatchNorm share of one profiled forward+backward at W=1 and W=8, and W=8 / W=1 again
with trainer.compile=true (--compile-models, resnet20 by default: compiling takes most of a minute per
configuration); then bench/batchnorm.py's BN layer alone in bf16 (per-chunk, the old fold, the compiled form run
eagerly, W=1); (b) the step `lbt plan plan.gpu=PRESET` predicts (lbt.apps.plan.compute.gpu_compute: FLOPs over
the preset's bf16 peak at the default utilisation; the preset is read from the GPU's name) against lbt's
measured forward+backward at W=1, with the utilisation measured; (c) `python -m pytest -q -n 8`, the whole
suite, in the time left (cut, and said so, when it runs out; LBT_SKIP_POSTGRES=1 where no PostgreSQL is
installed). Its last line is `gpu_sim_ratio=R plan_gpu_error=E gpu_suite_failures=N`: R the worse eager
W=8 / W=1 of the two models, E the worse |relative error| of (b), N the suite's failures and errors (-1: not
run). Without CUDA: `no_cuda`, exit 0.

On an offline GPU machine whose image has PyTorch but not lbt's other dependencies, carry them as wheels
(bench/offline_wheels.py, run where pip reaches an index), and install them and the checkout into the
Python that has PyTorch (the suite's tests run `python -m lbt` from other folders, and one installs lbt):
    python bench/offline_wheels.py .whl --python 3.12 --have their-packages.txt                # here
    python3 -m pip install -q --no-index --no-deps .whl/*.whl &&                               # there
    python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . &&
    PYTHONUNBUFFERED=1 python3 bench/gpu.py --all
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import glob
import io
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Callable, TypeVar

import torch
from _common import REPO, build_data, build_model, compose, headline, interleaved, median, pair_ratios, spread, sync

from lbt.cost.gpu import DEFAULT_UTILIZATION, GPUS
from lbt.engine import make_spec, run
from lbt.engine.build import build_model as engine_model
from lbt.engine.build import data_shape
from lbt.errors import ConfigError, first_line
from lbt.spec.targets import target_of

NO_GPU = "bench/gpu.py: no CUDA GPU on this machine; nothing measured (it compares lbt with a plain loop on a GPU)"
GPU_BASE = ["trainer.progress=false", "trainer.precision=bf16", "trainer.channels_last=true",
            "trainer.evals=0", "data=synthetic", "data.num_test=256", "optim=sgd"]
# name -> (overrides, global batch, steps, quick steps)
CASES = {
    "resnet20": (["model=resnet20", "data.input_shape=[3,32,32]", "data.num_train=32768"], 512, 60, 20),
    "resnet50": (["model=torchvision", "model.name=resnet50", "data.input_shape=[3,224,224]",
                  "data.num_train=2048", "data.num_classes=1000"], 128, 15, 6),
}


# --all --device cpu: the same code on small cases, a dry run of what a GPU runs (name -> as CASES).
CPU_CASES = {
    "resnet20": (["model=resnet20", "data.input_shape=[3,32,32]", "data.num_train=256"], 32, 2, 2),
    "resnet50": (["model=torchvision", "model.name=resnet50", "data.input_shape=[3,64,64]", "data.num_train=64",
                  "data.num_classes=1000"], 16, 2, 2),
}


def cases_for(device: str) -> dict:
    return CPU_CASES if device == "cpu" else CASES


def lbt_overrides(case: str, world_size: int, steps: int, variant: tuple[str, ...] = (),
                  device: str = "cuda") -> list[str]:
    overrides, batch, _, _ = cases_for(device)[case]
    return [*GPU_BASE, f"trainer.device={device}", *overrides, f"dist.world_size={world_size}", "dist.procs=1",
            f"trainer.global_batch={batch}", "trainer.epochs=1", f"trainer.max_steps={steps}", *variant]


class LbtRun:
    def __init__(self, case: str, world_size: int, steps: int, variant: tuple[str, ...] = (), device: str = "cuda"):
        self.overrides, self.steps = lbt_overrides(case, world_size, steps, variant, device), steps
        self.step_seconds: list[dict] = []

    def __call__(self) -> float:
        config, recipe = compose(self.overrides)
        spec = make_spec(config, recipe, self.overrides)
        with tempfile.TemporaryDirectory(prefix="lbt-gpu-bench-") as run_dir:
            with contextlib.redirect_stdout(io.StringIO()):
                result = run(spec, run_dir)
        if result.steps != self.steps:
            raise RuntimeError(f"lbt ran {result.steps} steps, expected {self.steps}")
        self.step_seconds.append(result.step_seconds)
        return result.samples_per_sec


class PlainLoop:
    """What a user writes without a framework, on the same model, data path, precision and layout."""

    def __init__(self, case: str, steps: int, device: str = "cuda"):
        self.config, _ = compose(lbt_overrides(case, 1, steps, device=device))
        self.steps, self.batch, self.device = steps, cases_for(device)[case][1], torch.device(device)
        self.data = None

    def __call__(self) -> float:
        device = self.device
        if self.data is None:
            self.data = build_data(self.config).to(device)
        model, optimizer, loss_fn = build_model(self.config, self.data)
        model = model.to(device, memory_format=torch.channels_last)
        x_all, y_all, b = self.data.train.x, self.data.train.y, self.batch
        perm = torch.randperm(len(y_all), generator=torch.Generator().manual_seed(0)).to(device)
        model.train()
        sync(device)
        start = time.perf_counter()
        for step in range(self.steps):
            idx = perm[step * b:(step + 1) * b]
            inputs = x_all.index_select(0, idx).contiguous(memory_format=torch.channels_last)
            labels = y_all.index_select(0, idx)
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = loss_fn(model(inputs), labels)
            loss.backward()
            optimizer.step()
        sync(device)
        return self.steps * b / (time.perf_counter() - start)


def split_line(step_seconds: list[dict]) -> str:
    phases = ("data_s", "compute_s", "comm_s", "optimizer_s")
    return ", ".join(f"{p[:-2]} {median([s.get(p, 0.0) for s in step_seconds]) * 1e3:.2f} ms" for p in phases)


def measure_variants(name: str, steps: int, variants: list[str], repeats: int) -> list[str]:
    """W=1 and W=8 of `name` again under each override (one table row each): where the simulated pass loses."""
    rows = []
    for variant in variants:
        runs = {"w1": LbtRun(name, 1, steps, (variant,)), "w8": LbtRun(name, 8, steps, (variant,))}
        LbtRun(name, 1, max(2, steps // 5), (variant,))(), LbtRun(name, 8, max(2, steps // 5), (variant,))()
        values = interleaved(runs, repeats)
        rows.append(f"| {name} | `{variant}` | {spread(values['w1'])} | {spread(values['w8'])} | "
                    f"{median(pair_ratios(values['w8'], values['w1'])):.3f} | {split_line(runs['w8'].step_seconds)} |")
    return rows


def variant_error(model: str, variants: list[str]) -> str | None:
    """A --variant that lbt refuses, said before any measurement rather than after the first model's."""
    for variant in variants:
        overrides = lbt_overrides(model, 8, 1, (variant,))
        try:
            make_spec(*compose(overrides), overrides)
        except ConfigError as error:
            return f"bench/gpu.py: --variant {variant}: {error}"
    return None


def print_variants(rows: list[str]) -> None:
    if rows:
        print("\n| model | variant | lbt W=1 samples/s | lbt W=8 simulated samples/s | W=8 / W=1 | W=8 step split |")
        print("| --- | --- | ---: | ---: | ---: | --- |")
        print("\n".join(rows))

# -- --all: one command, about 8 minutes on one H200 -------------------------------------------------------
ALL_BUDGET_S = 470  # the whole of --all; the suite (c) gets what (a) and (b) leave of it
COMPILE_LEAVES_S = 300  # compile a model only with this much of the budget left (the suite takes ~4-5 minutes)
T = TypeVar("T")
SUITE = ["-m", "pytest", "-q", "-n", "8", "--dist", "loadfile", "-p", "no:cacheprovider"]


def gpu_preset(device_name: str) -> str | None:
    """lbt's GPU preset (lbt/cost/gpu.py) named in torch.cuda.get_device_name(): "NVIDIA H200" -> "h200"."""
    for name in GPUS:
        if re.search(rf"\b{re.escape(name)}\b", device_name, re.IGNORECASE):
            return name
    return None


def bn_shares(case: str, device: str) -> dict[str, tuple[float, float]]:
    """"W=1"/"W=8" -> (BN seconds, step seconds) of one profiled forward+backward of the case's model, bf16
    autocast, channels_last, on random inputs (bench/batchnorm.py's profile)."""
    from batchnorm import PER_CHUNK, WORKERS, bn_share, worker_profiles

    config, _ = compose(lbt_overrides(case, 1, 1, device=device))
    shape = data_shape(target_of(config["data"], "data"))
    batch, dev = cases_for(device)[case][1], torch.device(device)
    torch.manual_seed(0)
    model = engine_model(target_of(config["model"], "model"), shape.input_shape, shape.num_classes)
    model = model.to(dev).to(memory_format=torch.channels_last)
    x = torch.randn(batch, *shape.input_shape, device=dev).contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, shape.num_classes or 1000, (batch,), device=dev)
    profiles = worker_profiles(model, x, y, dev, torch.bfloat16, {f"W={WORKERS}": PER_CHUNK})
    return {name: bn_share(prof.events(), dev) for name, prof in profiles.items()}


def plan_check(case: str, device: str, preset: str, measured_s: float) -> dict[str, float]:
    """`lbt plan plan.gpu=PRESET`'s step (lbt/apps/plan/compute.py gpu_compute: forward+backward FLOPs over the
    preset's bf16 peak at the default utilisation) against lbt's measured compute per step at W=1."""
    from lbt.apps.plan.compute import gpu_compute, step_flops

    config, _ = compose(lbt_overrides(case, 1, 1, device=device))
    model, shape = target_of(config["model"], "model"), data_shape(target_of(config["data"], "data"))
    batch = cases_for(device)[case][1]
    predicted = gpu_compute(model, shape, batch, GPUS[preset], "bf16", DEFAULT_UTILIZATION, case)
    flops = sum(step_flops(model, shape, batch, case))
    predicted_s = predicted.forward_s + predicted.backward_s
    return {"predicted_s": predicted_s, "measured_s": measured_s, "error": predicted_s / measured_s - 1,
            "utilization": flops / (measured_s * GPUS[preset].tflops["bf16"] * 1e12)}


def measure_all_model(case: str, device: str, repeats: int) -> dict:
    """(a) for one model: plain, lbt W=1, lbt W=8 (interleaved after a warm-up each) and the BN shares."""
    _, batch, steps, _ = cases_for(device)[case]
    w1 = LbtRun(case, 1, steps, device=device)
    runs = {"plain": PlainLoop(case, steps, device), "lbt": w1, "lbt_w8": LbtRun(case, 8, steps, device=device)}
    warm = max(2, steps // 5)
    PlainLoop(case, warm, device)(), LbtRun(case, 1, warm, device=device)(), LbtRun(case, 8, warm, device=device)()
    values = interleaved(runs, repeats)
    return {"batch": batch, "steps": steps, "values": values,
            "compute_s": median([s["compute_s"] for s in w1.step_seconds]),
            "vs_plain": median(pair_ratios(values["lbt"], values["plain"])),
            "w8_w1": median(pair_ratios(values["lbt_w8"], values["lbt"])),
            "bn": attempt(f"(a) {case} BN share", functools.partial(bn_shares, case, device)) or {}}


def measure_compiled(case: str, device: str, repeats: int) -> float:
    """W=8 / W=1 with trainer.compile=true (the per-worker BN's grouped form under torch.compile)."""
    _, _, steps, _ = cases_for(device)[case]
    runs = {w: LbtRun(case, w, steps, ("trainer.compile=true",), device) for w in (1, 8)}
    for run_ in runs.values():  # the compile itself, unmeasured
        run_()
    values = interleaved({str(w): run_ for w, run_ in runs.items()}, repeats)
    return median(pair_ratios(values["8"], values["1"]))


def suite_counts(output: str) -> tuple[int, int, list[str]]:
    """(passed, failed + errors, failed ids) from pytest -q's output (its summary, or the progress so far)."""
    ids = [line.split()[1] for line in output.splitlines() if line.startswith(("FAILED ", "ERROR "))]
    summary = [line for line in output.splitlines() if re.search(r"\d+ (passed|failed)", line)]
    if not summary:
        progress = "".join(line.split("[")[0] for line in output.splitlines()
                           if re.fullmatch(r"[.FEsxX]+\s*(\[.*\])?", line))
        return progress.count("."), progress.count("F") + progress.count("E"), ids
    counts = {kind: int(n) for n, kind in re.findall(r"(\d+) (passed|failed|errors?)", summary[-1])}
    return counts.get("passed", 0), counts.get("failed", 0) + counts.get("error", 0) + counts.get("errors", 0), ids


def run_suite(seconds: float) -> tuple[int, int, list[str], bool, str]:
    """The whole test suite with 8 xdist workers, cut after `seconds` (the process group killed): counts,
    failed ids, whether it finished, and the end of its output."""
    env = dict(os.environ)
    if not (shutil.which("pg_ctl") or glob.glob("/usr/lib/postgresql/*/bin/pg_ctl")):
        # A GPU machine seldom has PostgreSQL, and the tuning storage tests are not about the GPU.
        print("no PostgreSQL here: the suite runs with LBT_SKIP_POSTGRES=1 (tests/test_tune_storage.py)", flush=True)
        env["LBT_SKIP_POSTGRES"] = "1"
    job = subprocess.Popen([sys.executable, *SUITE], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True, start_new_session=True, env=env)
    try:
        output, finished = job.communicate(timeout=max(seconds, 1))[0], True
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)
        output, finished = job.communicate()[0], False
    return (*suite_counts(output), finished, output[-2000:])


def print_all(results: dict, compiled: dict, plans: dict) -> None:
    print("\n| model | global batch | plain samples/s | lbt samples/s | lbt / plain | lbt W=8 samples/s | W=8 / W=1 | "
          "W=8 / W=1 compiled | BN share W=1 | BN share W=8 |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for case, r in results.items():
        shares = [f"{bn * 1e3:.1f} of {total * 1e3:.1f} ms ({bn / total:.0%})" for bn, total in r["bn"].values()]
        shares = shares or ["-", "-"]
        comp = f"{compiled[case]:.3f}" if case in compiled else "-"
        print(f"| {case} | {r['batch']} | {spread(r['values']['plain'])} | {spread(r['values']['lbt'])} | "
              f"{r['vs_plain']:.3f} | {spread(r['values']['lbt_w8'])} | {r['w8_w1']:.3f} | {comp} | "
              f"{' | '.join(shares)} |")
    print("(BN share: device time under BatchNorm ops in one profiled forward+backward of the model)")
    for case, p in plans.items():
        print(f"plan, {case}: predicted {p['predicted_s'] * 1e3:.2f} ms (forward+backward at "
              f"{DEFAULT_UTILIZATION:.0%} utilisation) against {p['measured_s'] * 1e3:.2f} ms measured (lbt W=1 "
              f"compute): error {p['error']:+.1%}; measured utilisation {p['utilization']:.1%}")


def attempt(label: str, fn: Callable[[], T]) -> T | None:
    """fn(), or None after one line saying why: one part failing must not cost the parts after it."""
    try:
        return fn()
    except Exception as error:  # noqa: BLE001 - any failure of one part is reported, and the run goes on
        print(f"{label}: FAILED: {type(error).__name__}: {first_line(error)}", flush=True)
        return None


def run_all(args: argparse.Namespace) -> int:
    """(a) lbt / plain, W=8 / W=1 eager and compiled, the BN share; (b) lbt plan's step against the measured
    one; (c) the test suite in the time left. Last line: `gpu_sim_ratio=R plan_gpu_error=E gpu_suite_failures=N`."""
    started, device = time.monotonic(), args.device
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU (dry run)"
    preset = args.gpu_preset or gpu_preset(name)
    print(f"--all on {name} (lbt preset {preset}), torch {torch.__version__}, budget {args.budget:.0f} s", flush=True)
    repeats = args.repeats or (1 if args.quick or device == "cpu" else 2)
    results, compiled, plans = {}, {}, {}
    for case in args.models:
        if (result := attempt(f"(a) {case}", functools.partial(measure_all_model, case, device, repeats))) is None:
            continue
        results[case] = result
        print(f"(a) {case}: W=8 / W=1 {result['w8_w1']:.3f} ({time.monotonic() - started:.0f} s)", flush=True)
        if preset is not None:
            plan = attempt(f"(b) {case}", functools.partial(plan_check, case, device, preset,
                                                            results[case]["compute_s"]))
            plans.update({case: plan} if plan is not None else {})
    for case in args.compile_models:
        if args.budget - (time.monotonic() - started) < COMPILE_LEAVES_S:
            print(f"(a) {case} compiled: skipped, under {COMPILE_LEAVES_S} s left for it and the suite", flush=True)
        elif (ratio := attempt(f"(a) {case} compiled", functools.partial(measure_compiled, case, device,
                                                                          repeats))) is not None:
            compiled[case] = ratio
            print(f"(a) {case} compiled: W=8 / W=1 {ratio:.3f} ({time.monotonic() - started:.0f} s)", flush=True)
    print_all(results, compiled, plans)
    attempt("BN layer alone", lambda: layers(device))
    failures = run_suite_part(args.budget - (time.monotonic() - started)) if args.suite else -1
    ratio = min((r["w8_w1"] for r in results.values()), default=float("nan"))
    error = max((abs(p["error"]) for p in plans.values()), default=float("nan"))
    print(f"gpu_sim_ratio={ratio:.3f} plan_gpu_error={error:.3f} gpu_suite_failures={failures}", flush=True)
    return 0


def run_suite_part(left: float) -> int:
    """(c): the suite's failures and errors, -1 when it said nothing countable (its output's end printed)."""
    print(f"\n(c) python {' '.join(SUITE)}, {left:.0f} s left ...", flush=True)
    passed, failures, ids, finished, tail = run_suite(left)
    print(f"suite: {passed} passed, {failures} failed{'' if finished else ' (cut: it ran out of time)'}"
          + "".join(f"\n  {i}" for i in ids), flush=True)
    if passed == failures == 0:
        print(f"the suite ran no test; the end of its output:\n{tail}")
        return -1
    return failures


def layers(device: str) -> None:
    """bench/batchnorm.py's (i) on this device, bf16: the BN layer alone, per-chunk / fold / grouped / W=1."""
    from batchnorm import measure_layers, print_layers

    repeats = 3 if device == "cuda" else 1
    print("\nthe BN layer alone (bench/batchnorm.py --device DEVICE --dtype bf16), resnet20's shapes ...", flush=True)
    print_layers(measure_layers(torch.device(device), torch.bfloat16, repeats, 20 if device == "cuda" else 1), repeats)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1 repeat and fewer steps")
    parser.add_argument("--repeats", type=int, help="interleaved repeats per figure (default 3, quick 1)")
    parser.add_argument("--models", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--variant", action="append", default=[], metavar="OVERRIDE",
                        help="run W=1 and W=8 again with this lbt override added (repeatable)")
    parser.add_argument("--all", action="store_true", help="(a) W=8 / W=1 with BN shares and compiled, (b) lbt "
                        "plan's step against the measured one, (c) the test suite: one command, about 8 minutes")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                        help="--all on the CPU: a dry run on small cases (no suite)")
    parser.add_argument("--gpu-preset", choices=list(GPUS), help="--all: lbt's preset for (b) (default: from the "
                        "GPU's name)")
    parser.add_argument("--compile-models", nargs="*", choices=list(CASES), default=None,
                        help="--all: the models timed compiled too (default resnet20 on a GPU, none on the CPU)")
    parser.add_argument("--suite", action=argparse.BooleanOptionalAction, default=None,
                        help="--all: run the test suite at the end (default on a GPU)")
    parser.add_argument("--budget", type=float, default=ALL_BUDGET_S, help="--all: seconds for everything")
    args = parser.parse_args(argv)
    if args.all:
        if args.device == "cuda" and not torch.cuda.is_available():
            print("no_cuda")
            return 0
        on_gpu = args.device == "cuda"
        args.compile_models = (["resnet20"] if on_gpu else []) if args.compile_models is None else args.compile_models
        args.suite = on_gpu if args.suite is None else args.suite
        return run_all(args)
    if not torch.cuda.is_available():
        print(NO_GPU)
        return 0
    if (error := variant_error(args.models[0], args.variant)) is not None:
        print(error)
        return 2
    repeats = args.repeats or (1 if args.quick else 3)
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}", flush=True)
    rows, ratios, variant_rows = [], {}, []
    for name in args.models:
        _, batch, steps, quick_steps = CASES[name]
        steps = quick_steps if args.quick else steps
        plain, lbt = PlainLoop(name, steps), LbtRun(name, 1, steps)
        simulated = LbtRun(name, 8, steps)
        warm = max(2, steps // 5)
        PlainLoop(name, warm)(), LbtRun(name, 1, warm)(), LbtRun(name, 8, warm)()  # CUDA context, cuDNN, caches
        print(f"{name}: {steps} steps of global batch {batch}, {repeats} interleaved repeats ...", flush=True)
        values = interleaved({"plain": plain, "lbt": lbt, "lbt_w8": simulated}, repeats)
        vs_plain = pair_ratios(values["lbt"], values["plain"])
        vs_w1 = pair_ratios(values["lbt_w8"], values["lbt"])
        ratios[name] = median(vs_plain)
        rows.append((name, batch, steps, values, vs_plain, vs_w1, lbt.step_seconds, simulated.step_seconds))
        variant_rows += measure_variants(name, steps, args.variant, repeats)
    print()
    print("| model | global batch | steps | plain samples/s | lbt samples/s | lbt / plain | "
          "lbt W=8 simulated samples/s | W=8 / W=1 |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, batch, steps, values, vs_plain, vs_w1, _, _ in rows:
        print(f"| {name} | {batch} | {steps} | {spread(values['plain'])} | {spread(values['lbt'])} | "
              f"{median(vs_plain):.3f} | {spread(values['lbt_w8'])} | {median(vs_w1):.3f} |")
    print("(samples/s: median (min-max, n); ratios: medians of the per-repeat ratios)")
    for name, _, _, _, _, _, w1_split, w8_split in rows:
        print(f"step split, {name}: W=1: {split_line(w1_split)}; W=8 simulated: {split_line(w8_split)}")
    print_variants(variant_rows)
    worst = min(ratios, key=ratios.get)
    w8 = min(median(row[5]) for row in rows)
    print(f"targets: lbt / plain >= 0.97: {'met' if ratios[worst] >= 0.97 else 'MISSED'} (worst {worst} "
          f"{ratios[worst]:.3f}); W=8 / W=1 >= 0.9: {'met' if w8 >= 0.9 else 'MISSED'} ({w8:.3f})")
    headline("gpu_ratio", ratios[worst])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
