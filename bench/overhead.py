"""lbt's training speed against a hand-written plain PyTorch loop (target: ratio >= 0.97).

    python bench/overhead.py              # full: 7 interleaved repeats per model
    python bench/overhead.py --quick      # under 2 minutes: 3 repeats, fewer steps
    python bench/overhead.py --profile    # also cProfile both loops on cnn1d (where does lbt's time go?)
    python bench/overhead.py --account    # also time lbt's per-step bookkeeping on cnn1d, method by method

Both sides train the same model (built from the same composed config), on the
same in-memory data, batch 64, SGD (momentum 0.9, weight decay 5e-4), the
same number of steps and the same torch.set_num_threads:
- lbt: `lbt.engine.run` with world_size=1, max_steps=S (its real path: LR
  schedule per step, loss/accuracy bookkeeping, TensorBoard every 10 steps);
  its samples_per_sec covers the training steps only (no evaluation).
- plain: for each step, index a batch from a random permutation, zero_grad,
  forward, cross-entropy, backward, step. Nothing else.
Warm-up is excluded: each side runs once, unmeasured, before the repeats.
The two alternate (ABBA) inside one loop of repeats; the ratio is the median
of the per-repeat ratios lbt / plain. The last line is
`overhead_ratio=<worst model's ratio>`.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time
from collections import defaultdict

import torch
from _common import (
    CASES,
    Case,
    LoadWatch,
    build_data,
    build_model,
    compose,
    describe_machine,
    headline,
    interleaved,
    median,
    median_interval,
    pair_ratios,
    run_lbt,
    spread,
)

from lbt.engine.step import StepRunner
from lbt.engine.trainer import Trainer
from lbt.metrics.tensorboard import RunLogger


class PlainLoop:
    """The hand-written baseline: what a user writes without any framework."""

    def __init__(self, case: Case, steps: int, threads: int):
        self.steps, self.threads, self.batch = steps, threads, case.batch
        self.config, _ = compose(case.lbt_overrides(steps))
        self.data = None
        self.profiler: cProfile.Profile | None = None  # set by profile(): covers the loop only

    def __call__(self) -> float:
        torch.set_num_threads(self.threads)
        if self.data is None:
            self.data = build_data(self.config)
        model, optimizer, loss_fn = build_model(self.config, self.data)
        x_all, y_all = self.data.train.x, self.data.train.y
        b = self.batch
        model.train()
        if self.profiler is not None:
            self.profiler.enable()
        start = time.perf_counter()
        generator, per_epoch = torch.Generator().manual_seed(0), len(y_all) // b
        for step in range(self.steps):
            if step % per_epoch == 0:  # a new epoch: a new permutation, as lbt draws one
                perm = torch.randperm(len(y_all), generator=generator)
            idx = perm[step % per_epoch * b:(step % per_epoch + 1) * b]
            inputs, labels = x_all[idx], y_all[idx]
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(model(inputs), labels)
            loss.backward()
            optimizer.step()
        elapsed = time.perf_counter() - start
        if self.profiler is not None:
            self.profiler.disable()
        return self.steps * b / elapsed


class LbtRun:
    def __init__(self, case: Case, steps: int, threads: int):
        self.overrides = case.lbt_overrides(steps, [f"trainer.threads={threads}"])
        self.steps = steps

    def __call__(self) -> float:
        result = run_lbt(self.overrides)
        if result.steps != self.steps:
            raise RuntimeError(f"lbt ran {result.steps} steps, expected {self.steps}")
        return result.samples_per_sec


def profile(fn, label: str, top: int = 25) -> str:
    """cProfile of the training loop alone: lbt's Trainer.train_epoch, or the plain loop's for-loop."""
    profiler = cProfile.Profile()
    if isinstance(fn, PlainLoop):
        fn.profiler = profiler
        fn()
        fn.profiler = None
    else:
        original = Trainer.train_epoch

        def profiled(self, *args, **kwargs):
            profiler.enable()
            try:
                return original(self, *args, **kwargs)
            finally:
                profiler.disable()

        Trainer.train_epoch = profiled
        try:
            fn()
        finally:
            Trainer.train_epoch = original
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    stats.sort_stats("tottime").print_stats(top)
    return f"--- cProfile of {label} (by own time) ---\n" + out.getvalue()


def account(case: Case, steps: int, threads: int, runs: int = 3) -> str:
    """Wall time per step of the Trainer's methods in real lbt runs (perf_counter wrappers, ~1 us each)."""
    spent: dict[str, float] = defaultdict(float)
    targets = [(Trainer, "train_epoch"), (StepRunner, "step"), (Trainer, "set_lr"),
               (RunLogger, "scalars"), (torch.optim.SGD, "zero_grad"), (torch.optim.SGD, "step")]
    originals = {(owner, name): getattr(owner, name) for owner, name in targets}

    def timed(label, fn):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[label] += time.perf_counter() - start
        return wrapper

    for (owner, name), fn in originals.items():
        setattr(owner, name, timed(f"{owner.__name__}.{name}", fn))
    try:
        run = LbtRun(case, steps, threads)
        for _ in range(runs):
            run()
    finally:
        for (owner, name), fn in originals.items():
            setattr(owner, name, fn)
    total = steps * runs
    per_step = {k: v / total * 1e6 for k, v in spent.items()}
    loop_rest = per_step["Trainer.train_epoch"] - sum(
        per_step[k] for k in ("StepRunner.step", "Trainer.set_lr", "RunLogger.scalars"))
    lines = [f"--- lbt's step, method by method ({case.name}, {steps} steps x {runs} runs, {threads} thread(s)) ---"]
    lines += [f"{k:24s} {v:9.1f} us per step" for k, v in sorted(per_step.items(), key=lambda kv: -kv[1])]
    lines.append(f"{'rest of the loop body':24s} {loop_rest:9.1f} us per step (batch gather, loss window, timers)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="3 repeats and fewer steps (under 2 minutes)")
    parser.add_argument("--repeats", type=int, help="interleaved repeats per model (default 7, quick 3)")
    parser.add_argument("--models", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads on both sides (default 1: see bench/README.md, ## Speed)")
    parser.add_argument("--profile", action="store_true", help="cProfile one run of each side on cnn1d")
    parser.add_argument("--account", action="store_true", help="time lbt's per-step methods on cnn1d")
    args = parser.parse_args(argv)
    repeats = args.repeats or (3 if args.quick else 7)
    print(describe_machine(), flush=True)
    watch = LoadWatch(own=args.threads)
    ratios: dict[str, float] = {}
    rows = []
    for name in args.models:
        case = CASES[name]
        steps = case.quick_steps if args.quick else case.steps
        plain, lbt = PlainLoop(case, steps, args.threads), LbtRun(case, steps, args.threads)
        warm_steps = max(2, steps // 10)
        PlainLoop(case, warm_steps, args.threads)(), LbtRun(case, warm_steps, args.threads)()
        print(f"{name}: {steps} steps of batch {case.batch}, {repeats} interleaved repeats ...", flush=True)
        values = interleaved({"plain": plain, "lbt": lbt}, repeats, watch)
        if torch.get_num_threads() != args.threads:
            raise RuntimeError(f"thread count drifted: {torch.get_num_threads()} != {args.threads}")
        per_pair = pair_ratios(values["lbt"], values["plain"])
        ratios[name] = median(per_pair)
        rows.append((name, steps, values, per_pair))
        print(f"  plain {spread(values['plain'])} samples/s | lbt {spread(values['lbt'])} samples/s | "
              f"lbt/plain per repeat: {', '.join(f'{r:.3f}' for r in per_pair)}", flush=True)
    print()
    print("| model | data | batch | steps | threads | plain samples/s | lbt samples/s | lbt / plain |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, steps, values, per_pair in rows:
        data = "MNIST-1D" if name == "cnn1d" else "synthetic 3x32x32"
        interval = "-".join(f"{v:.3f}" for v in median_interval(per_pair))
        print(f"| {name} | {data} | {CASES[name].batch} | {steps} | {args.threads} | {spread(values['plain'])} | "
              f"{spread(values['lbt'])} | {median(per_pair):.3f} (90% interval {interval}; "
              f"min {min(per_pair):.3f}, max {max(per_pair):.3f}) |")
    print("(samples/s: median (min-max, n); lbt / plain: median of the per-repeat ratios, its bootstrap interval)")
    print(watch.verdict())
    if args.profile:
        case = CASES["cnn1d"]
        steps = case.quick_steps if args.quick else case.steps
        print(profile(LbtRun(case, steps, args.threads), f"lbt, cnn1d, {steps} steps"))
        print(profile(PlainLoop(case, steps, args.threads), f"plain loop, cnn1d, {steps} steps"))
    if args.account:
        case = CASES["cnn1d"]
        print(account(case, case.quick_steps if args.quick else case.steps, args.threads))
    worst = min(ratios, key=ratios.get)
    print(f"worst: {worst} ({ratios[worst]:.3f}); target >= 0.97: {'met' if ratios[worst] >= 0.97 else 'MISSED'}")
    headline("overhead_ratio", ratios[worst])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
