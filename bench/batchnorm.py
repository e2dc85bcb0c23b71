"""What per-worker BatchNorm costs: a fused pass's BN layer at W=8 against plain BN at W=1, before and after.

    python bench/batchnorm.py                # (i) the BN layer alone in resnet20's shapes, 9 interleaved repeats
    python bench/batchnorm.py --quick        # (i) with 3 repeats
    python bench/batchnorm.py --steps        # and (ii) whole training steps, fold against per-chunk
    python bench/batchnorm.py --profile      # and (iii) torch.profiler's op table of one resnet20 step at W=8
    python bench/batchnorm.py --device cuda --dtype bf16   # (i) and (iii) on a GPU (bench/gpu.py --all runs it)
    python bench/batchnorm.py --fold-simulation --no-procs # bench/simulation.py, its arguments, on the fold

When W workers share one pass, every BatchNorm normalises each worker's b-sample chunk on its own
(lbt/nn/batchnorm.py). Three ways to do that are timed:
- per-chunk: lbt's `ghost_batch_norm`, BN's own ATen kernels called on each chunk's view, writing into
  slices of one output (no copy of the batch in the forward, one per chunk in the backward);
- fold: the implementation it replaced, kept here only as the "before": the chunks folded into channels,
  one F.batch_norm over (b, W*C, ...), unfolded; two copies of the batch each way;
- grouped: what lbt runs under torch.compile (`grouped_batch_norm`: reductions over a (W, b, C, ...) view),
  here run eagerly, for comparison only.
(i) forward+backward of one BN layer at global batch 512 in the shapes of resnet20's 19 BN layers (7 at
    16x32x32, 6 at 32x16x16, 6 at 64x8x8), NCHW and channels_last: W=1 is F.batch_norm over all 512 samples
    (one worker of batch 512); the W=8 contenders have 8 chunks of 64. Contenders alternate inside each repeat;
    each figure is the median (min-max) over repeats, each ratio the median of the per-repeat ratios.
    Target on CPU: per-chunk W=8 / W=1 <= 1.2 over resnet20's 19 BN layers (each shape is shown too).
(ii) samples/s of whole training steps through `lbt.engine.run` on the CPU, fused workers
    (dist.fuse_workers=true), per-chunk against fold, and W=1 at the same global batch: resnet20 at
    global batch 512 (W=8), cnn1d on MNIST-1D at 4,096 (W=16 and W=128, bench/simulation.py's case).
(iii) torch.profiler of one resnet20 forward+backward at batch 512, W=8 fold and per-chunk, W=1: the top ops
    and the BN share of the step.
The last line is `bn_ratio=<per-chunk W=8 / W=1 time of (i) over resnet20's 19 BN layers, the worse layout>`.
"""

from __future__ import annotations

import argparse
import contextlib
import time
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from _common import LoadWatch, describe_machine, headline, interleaved, median, pair_ratios, sync, timed_run
from torch.autograd import DeviceType

import lbt.nn.batchnorm as lbt_batchnorm
from lbt.engine.passes import per_worker_batchnorm
from lbt.models import ResNet20

BATCH, WORKERS = 512, 8
# resnet20's BN layers at CIFAR's 32x32: (channels, side), how many layers have that shape.
SHAPES = [((16, 32), 7), ((32, 16), 6), ((64, 8), 6)]
LAYOUTS = {"NCHW": torch.contiguous_format, "channels_last": torch.channels_last}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
PER_CHUNK = lbt_batchnorm.ghost_batch_norm


# -- the fold this replaced (the "before"; not in lbt) ------------------------------------------------------
def fold_ghost_batch_norm(x, virtual_batch, weight=None, bias=None, eps=1e-5, running_mean=None, running_var=None,
                          momentum=0.1):
    """lbt's ghost_batch_norm until 2026-12-03: chunk j's channels become channels j*C..j*C+C-1 of a
    (v, chunks*C, *) tensor, one F.batch_norm, and back (two copies each way; channels_last folded with its
    channels innermost)."""
    n, c, rest = x.shape[0], x.shape[1], x.shape[2:]
    chunks = n // virtual_batch
    if chunks == 1:
        return F.batch_norm(x, running_mean, running_var, weight, bias, True, momentum, eps)
    nhwc = x.dim() == 4 and not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last)
    folded = _fold_channels_last(x, chunks) if nhwc else (
        x.reshape(chunks, virtual_batch, c, *rest).transpose(0, 1).reshape(virtual_batch, chunks * c, *rest))

    def tile(t):
        return None if t is None else t.repeat(chunks)

    chunk_mean, chunk_var = tile(running_mean), tile(running_var)
    out = F.batch_norm(folded, chunk_mean, chunk_var, tile(weight), tile(bias), True, momentum, eps)
    if running_mean is not None and running_var is not None:
        with torch.no_grad():
            running_mean.copy_(chunk_mean.view(chunks, c).mean(0))
            running_var.copy_(chunk_var.view(chunks, c).mean(0))
    if nhwc:
        return _unfold_channels_last(out, chunks)
    return out.reshape(virtual_batch, chunks, c, *rest).transpose(0, 1).reshape(x.shape)


def _fold_channels_last(x: torch.Tensor, chunks: int) -> torch.Tensor:
    n, c, h, w = x.shape
    nhwc = x.permute(0, 2, 3, 1).reshape(chunks, n // chunks, h, w, c)
    return nhwc.permute(1, 2, 3, 0, 4).reshape(n // chunks, h, w, chunks * c).permute(0, 3, 1, 2)


def _unfold_channels_last(out: torch.Tensor, chunks: int) -> torch.Tensor:
    v, folded_c, h, w = out.shape
    nhwc = out.permute(0, 2, 3, 1).reshape(v, h, w, chunks, folded_c // chunks)
    return nhwc.permute(3, 0, 1, 2, 4).reshape(chunks * v, h, w, folded_c // chunks).permute(0, 3, 1, 2)


def grouped(x, virtual_batch, weight=None, bias=None, eps=1e-5, running_mean=None, running_var=None, momentum=0.1):
    return lbt_batchnorm.grouped_batch_norm(x, x.shape[0] // virtual_batch, weight, bias, eps, running_mean,
                                            running_var, momentum)


@contextlib.contextmanager
def implementation(fn: Callable) -> Iterator[None]:
    """Every GhostBatchNorm runs `fn` as its ghost_batch_norm inside the block (it looks the name up per call)."""
    saved = lbt_batchnorm.ghost_batch_norm
    lbt_batchnorm.ghost_batch_norm = fn
    try:
        yield
    finally:
        lbt_batchnorm.ghost_batch_norm = saved


# -- (i) the BN layer alone --------------------------------------------------------------------------------
def layer_timer(fn: Callable, virtual_batch: int, x: torch.Tensor, grad: torch.Tensor, iters: int) -> Callable:
    """A contender: seconds per forward+backward of `fn` on x (BN parameters and running stats of its channels),
    the mean over `iters` calls after one unmeasured call."""
    channels = x.shape[1]
    weight = torch.ones(channels, device=x.device, requires_grad=True)
    bias = torch.zeros(channels, device=x.device, requires_grad=True)
    mean, var = torch.zeros(channels, device=x.device), torch.ones(channels, device=x.device)
    x = x.detach().requires_grad_()

    def once() -> None:
        fn(x, virtual_batch, weight, bias, 1e-5, mean, var, 0.1).backward(grad)
        x.grad = weight.grad = bias.grad = None

    def timed() -> float:
        once()
        sync(x.device)
        start = time.perf_counter()
        for _ in range(iters):
            once()
        sync(x.device)
        return (time.perf_counter() - start) / iters

    return timed


def layer_contenders(channels: int, side: int, layout: str, device: torch.device, dtype: torch.dtype,
                     iters: int) -> dict[str, Callable]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(BATCH, channels, side, side, generator=generator).to(device, dtype)
    x = x.contiguous(memory_format=LAYOUTS[layout])
    grad = torch.randn(x.shape, generator=generator).to(device, dtype).contiguous(memory_format=LAYOUTS[layout])
    chunk = BATCH // WORKERS
    return {"W=1": layer_timer(PER_CHUNK, BATCH, x, grad, iters),
            "per-chunk": layer_timer(PER_CHUNK, chunk, x, grad, iters),
            "fold": layer_timer(fold_ghost_batch_norm, chunk, x, grad, iters),
            "grouped": layer_timer(grouped, chunk, x, grad, iters)}


def measure_layers(device: torch.device, dtype: torch.dtype, repeats: int, iters: int,
                   watch: LoadWatch | None = None) -> dict[tuple[str, int, int], dict[str, list[float]]]:
    """(layout, channels, side) -> contender -> seconds per forward+backward, one value per repeat."""
    results = {}
    for layout in LAYOUTS:
        for (channels, side), _ in SHAPES:
            contenders = layer_contenders(channels, side, layout, device, dtype, iters)
            results[(layout, channels, side)] = interleaved(contenders, repeats, watch)
            print(f"  {layout} {channels}x{side}x{side}: " + ", ".join(
                f"{name} {median(v) * 1e3:.2f} ms" for name, v in results[(layout, channels, side)].items()),
                flush=True)
    return results


def ms(values: list[float]) -> str:
    return f"{median(values) * 1e3:.2f} ({min(values) * 1e3:.2f}-{max(values) * 1e3:.2f})"


def print_layers(results: dict, repeats: int) -> tuple[float, float]:
    """The table of (i) and resnet20's 19 BN layers summed; returns the worst per-chunk / W=1 ratio of a layer
    shape and of the 19 layers (over the two layouts)."""
    print("\n| layout | BN input (N, C, H, W) | W=1 ms | W=8 per-chunk ms | W=8 fold ms | W=8 grouped ms | "
          "per-chunk / W=1 | fold / W=1 |\n| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    worst_shape = worst_step = 0.0
    for (layout, channels, side), v in results.items():
        chunk_ratio = median(pair_ratios(v["per-chunk"], v["W=1"]))
        worst_shape = max(worst_shape, chunk_ratio)
        print(f"| {layout} | ({BATCH}, {channels}, {side}, {side}) | {ms(v['W=1'])} | {ms(v['per-chunk'])} | "
              f"{ms(v['fold'])} | {ms(v['grouped'])} | {chunk_ratio:.3f} | "
              f"{median(pair_ratios(v['fold'], v['W=1'])):.3f} |")
    print(f"(ms per forward+backward: median (min-max) of {repeats} repeats; ratios: medians of per-repeat ratios)")
    for layout in LAYOUTS:  # resnet20's 19 BN layers, summed repeat by repeat
        totals = {name: [sum(count * results[(layout, c, s)][name][r] for (c, s), count in SHAPES)
                         for r in range(repeats)] for name in ("W=1", "per-chunk", "fold", "grouped")}
        step_ratio = median(pair_ratios(totals["per-chunk"], totals["W=1"]))
        worst_step = max(worst_step, step_ratio)
        print(f"resnet20's 19 BN layers, {layout}: W=1 {ms(totals['W=1'])} ms, per-chunk {ms(totals['per-chunk'])} "
              f"({step_ratio:.3f}x), fold {ms(totals['fold'])} "
              f"({median(pair_ratios(totals['fold'], totals['W=1'])):.3f}x), grouped {ms(totals['grouped'])}")
    return worst_shape, worst_step


# -- (ii) whole training steps -----------------------------------------------------------------------------
STEP_CASES = {  # name -> (lbt overrides, global batch, simulated world sizes, steps, quick steps)
    "resnet20": (["model=resnet20", "data=synthetic", "data.input_shape=[3,32,32]", "data.num_train=8192",
                  "data.num_test=256"], 512, [8], 4, 2),
    "cnn1d": (["model=cnn1d", "data=mnist1d"], 4096, [16, 128], 6, 3),
}


def step_overrides(case: str, world_size: int, steps: int, threads: int) -> list[str]:
    overrides, batch, _, _, _ = STEP_CASES[case]
    return [*overrides, f"dist.world_size={world_size}", "dist.procs=1", f"trainer.global_batch={batch}",
            "dist.fuse_workers=true", "trainer.epochs=1", f"trainer.max_steps={steps}", "trainer.evals=0",
            f"trainer.threads={threads}"]


def with_implementation(fn: Callable, run: Callable[[], float]) -> Callable[[], float]:
    def contender() -> float:
        with implementation(fn):
            return run()
    return contender


def measure_steps(case: str, repeats: int, quick: bool, threads: int, watch: LoadWatch) -> list[str]:
    _, batch, worlds, steps, quick_steps = STEP_CASES[case]
    steps = quick_steps if quick else steps
    contenders = {"W=1": timed_run(step_overrides(case, 1, steps, threads), steps)}
    for w in worlds:
        run = timed_run(step_overrides(case, w, steps, threads), steps)
        contenders[f"W={w} fold"] = with_implementation(fold_ghost_batch_norm, run)
        contenders[f"W={w} per-chunk"] = with_implementation(PER_CHUNK, run)
    for contender in contenders.values():  # warm-up: one unmeasured run each
        contender()
    print(f"  {case}: global batch {batch}, {steps} steps per run, {repeats} interleaved repeats ...", flush=True)
    values = interleaved(contenders, repeats, watch)
    return [f"| {case} | {name} | {batch // int(name.split()[0][2:])} | {median(v):,.0f} ({min(v):,.0f}-{max(v):,.0f})"
            f" | {median(pair_ratios(v, values['W=1'])):.3f} |" for name, v in values.items()]


# -- (iii) one step under torch.profiler -------------------------------------------------------------------
def bn_share(events, device: torch.device) -> tuple[float, float]:
    """(BN seconds, step seconds) of a profile: the ops under a BatchNorm op or autograd node (forward and
    backward, lbt's per-chunk Function included), by self time on `device` (CPU time on a CPU). On CUDA each
    kernel counts once, in the CPU op that launched it (the kernels' own events are skipped)."""
    def own(event) -> float:
        if device.type != "cuda":
            return event.self_cpu_time_total / 1e6
        return event.self_device_time_total / 1e6 if event.device_type == DeviceType.CPU else 0.0

    def in_bn(event) -> bool:
        while event is not None:
            name = event.name.lower()
            if "batch_norm" in name or "batchnorm" in name:
                return True
            event = event.cpu_parent
        return False

    total = sum(own(e) for e in events)
    return sum(own(e) for e in events if in_bn(e)), total


def profiled_step(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, device: torch.device, dtype: torch.dtype):
    """The profile of one forward+backward (after two unprofiled ones), autocast when dtype is bf16."""
    from torch.profiler import ProfilerActivity, profile

    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype == torch.bfloat16)

    def step() -> None:
        with autocast:
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        model.zero_grad(set_to_none=True)

    for _ in range(2):
        step()
    sync(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        step()
        sync(device)
    return prof


def worker_profiles(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, device: torch.device,
                    dtype: torch.dtype, per_worker: dict[str, Callable]) -> dict:
    """name -> profile of one step of `model`: "W=1" as built, then with per-worker BN of WORKERS workers (its
    BN layers replaced for good) under each ghost_batch_norm of `per_worker`."""
    profiles = {"W=1": profiled_step(model, x, y, device, dtype)}
    per_worker_batchnorm(model, len(x) // WORKERS)
    for name, fn in per_worker.items():
        with implementation(fn):
            profiles[name] = profiled_step(model, x, y, device, dtype)
    return profiles


def resnet20_profiles(device: torch.device, dtype: torch.dtype, batch: int = BATCH) -> dict:
    """One resnet20 step at `batch` in channels_last: W=1, W=8 fold, W=8 per-chunk."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(batch, 3, 32, 32, generator=generator).to(device).contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 10, (batch,), generator=generator).to(device)
    torch.manual_seed(0)
    model = ResNet20(input_shape=(3, 32, 32), num_classes=10).to(device).to(memory_format=torch.channels_last)
    return worker_profiles(model, x, y, device, dtype, {"W=8 fold": fold_ghost_batch_norm,
                                                        "W=8 per-chunk": PER_CHUNK})


def print_profiles(profiles: dict, device: torch.device, rows: int = 8) -> None:
    sort = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    for name, prof in profiles.items():
        bn, total = bn_share(prof.events(), device)
        print(f"\n{name}: step {total * 1e3:.1f} ms of {device.type} time, BN {bn * 1e3:.1f} ms ({bn / total:.0%})")
        print(prof.key_averages().table(sort_by=sort, row_limit=rows, max_name_column_width=48))


# -- main ---------------------------------------------------------------------------------------------------
def fold_simulation(args: list[str]) -> int:
    """bench/simulation.py on the fold: its figures before the per-chunk kernels (its real-process part
    starts fresh processes, which run lbt as it is: add --no-procs)."""
    import simulation

    with implementation(fold_ghost_batch_norm):
        return simulation.main(args)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="3 repeats, fewer steps")
    parser.add_argument("--repeats", type=int, help="interleaved repeats (default 9, quick 3)")
    parser.add_argument("--iters", type=int, default=5, help="forward+backward calls timed per repeat in (i)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1: steadier on shared cores)")
    parser.add_argument("--device", default="cpu", help="(i) and (iii) on this device (cpu, cuda)")
    parser.add_argument("--dtype", default="fp32", choices=list(DTYPES), help="(i)'s input dtype; bf16 profiles "
                        "(iii) under autocast")
    parser.add_argument("--steps", action="store_true", help="and (ii): whole training steps on the CPU")
    parser.add_argument("--profile", action="store_true", help="and (iii): torch.profiler of one resnet20 step")
    parser.add_argument("--fold-simulation", nargs=argparse.REMAINDER, metavar="ARGS",
                        help="run bench/simulation.py with ARGS on the fold instead, and nothing else")
    args = parser.parse_args(argv)
    if args.fold_simulation is not None:
        return fold_simulation(args.fold_simulation)
    torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    repeats = args.repeats or (3 if args.quick else 9)
    print(describe_machine(), flush=True)
    watch = LoadWatch(own=args.threads)
    print(f"(i) the BN layer, forward+backward, {args.dtype} on {device}, {repeats} interleaved repeats of "
          f"{args.iters} calls ...", flush=True)
    worst_shape, worst = print_layers(measure_layers(device, dtype, repeats, args.iters, watch), repeats)
    if args.steps:
        print("\n(ii) whole training steps, fused workers, on the CPU ...", flush=True)
        rows = [row for case in STEP_CASES for row in measure_steps(case, max(3, repeats // 2), args.quick,
                                                                    args.threads, watch)]
        print("\n| model | configuration | per_worker_batch | samples/s | / W=1 |\n| --- | --- | ---: | ---: | ---: |")
        print("\n".join(rows))
    if args.profile:
        print_profiles(resnet20_profiles(device, dtype), device)
    print(watch.verdict())
    print(f"per-chunk W=8 / W=1 of resnet20's 19 BN layers (worse layout): {worst:.3f}; target <= 1.2: "
          f"{'met' if worst <= 1.2 else 'MISSED'}; worst single layer shape {worst_shape:.3f}")
    headline("bn_ratio", worst)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
