"""lbt on a CUDA GPU: its speed against a plain PyTorch loop, simulated workers, and the step split.

    python bench/gpu.py              # 3 interleaved repeats per figure
    python bench/gpu.py --quick      # 1 repeat, fewer steps
    python bench/gpu.py --models resnet20
    python bench/gpu.py --variant dist.fuse_workers=false --variant trainer.channels_last=false   # where W=8 loses

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
"""

from __future__ import annotations

import argparse
import contextlib
import io
import tempfile
import time

import torch
from _common import build_data, build_model, compose, headline, interleaved, median, pair_ratios, spread

from lbt.engine import make_spec, run
from lbt.errors import ConfigError

NO_GPU = "bench/gpu.py: no CUDA GPU on this machine; nothing measured (it compares lbt with a plain loop on a GPU)"
GPU_BASE = ["trainer.progress=false", "trainer.device=cuda", "trainer.precision=bf16", "trainer.channels_last=true",
            "trainer.evals=0", "data=synthetic", "data.num_test=256", "optim=sgd"]
# name -> (overrides, global batch, steps, quick steps)
CASES = {
    "resnet20": (["model=resnet20", "data.input_shape=[3,32,32]", "data.num_train=32768"], 512, 60, 20),
    "resnet50": (["model=torchvision", "model.name=resnet50", "data.input_shape=[3,224,224]",
                  "data.num_train=2048", "data.num_classes=1000"], 128, 15, 6),
}


def lbt_overrides(case: str, world_size: int, steps: int, variant: tuple[str, ...] = ()) -> list[str]:
    overrides, batch, _, _ = CASES[case]
    return [*GPU_BASE, *overrides, f"dist.world_size={world_size}", "dist.procs=1", f"trainer.global_batch={batch}",
            "trainer.epochs=1", f"trainer.max_steps={steps}", *variant]


class LbtRun:
    def __init__(self, case: str, world_size: int, steps: int, variant: tuple[str, ...] = ()):
        self.overrides, self.steps = lbt_overrides(case, world_size, steps, variant), steps
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

    def __init__(self, case: str, steps: int):
        self.config, _ = compose(lbt_overrides(case, 1, steps))
        self.steps, self.batch = steps, CASES[case][1]
        self.data = None

    def __call__(self) -> float:
        device = torch.device("cuda")
        if self.data is None:
            self.data = build_data(self.config).to(device)
        model, optimizer, loss_fn = build_model(self.config, self.data)
        model = model.to(device, memory_format=torch.channels_last)
        x_all, y_all, b = self.data.train.x, self.data.train.y, self.batch
        perm = torch.randperm(len(y_all), generator=torch.Generator().manual_seed(0)).to(device)
        model.train()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for step in range(self.steps):
            idx = perm[step * b:(step + 1) * b]
            inputs = x_all.index_select(0, idx).contiguous(memory_format=torch.channels_last)
            labels = y_all.index_select(0, idx)
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = loss_fn(model(inputs), labels)
            loss.backward()
            optimizer.step()
        torch.cuda.synchronize()
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1 repeat and fewer steps")
    parser.add_argument("--repeats", type=int, help="interleaved repeats per figure (default 3, quick 1)")
    parser.add_argument("--models", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--variant", action="append", default=[], metavar="OVERRIDE",
                        help="run W=1 and W=8 again with this lbt override added (repeatable)")
    args = parser.parse_args(argv)
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
