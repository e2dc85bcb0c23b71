"""What each optimizer costs per step and per parameter, against AdamW, at transformer1d's size.

    python bench/optim_cost.py [--model transformer1d] [--repeats 7] [--steps 40] [--threads 1] [--profile soap]
    python bench/optim_cost.py --also "soap_heavyball=optim=soap optim.optimizer_class=heavyball.SOAP"

The model, optimizer and loss are built from the composed config (`model=M optim=O`), as `lbt train`
builds them (bench/_common.build_model); every contender trains the same MNIST-1D batches of 64 from the
same initial weights. A step is what the loop times: forward, backward, `optimizer.step()`, zero_grad;
the optimizer's part is timed alone too (a step minus the forward and backward it follows). Contenders
run in turns inside each repeat (bench/_common.interleaved), one thread each; each figure is the median
over the repeats, with its range.

Memory per parameter: the bytes of the optimizer's state tensors (momenta, second moments,
preconditioner factors, schedule-free's z) over the trainable parameters, so AdamW's is 8 (two fp32
tensors), SGD-momentum's 4; the parameters and gradients themselves (8 more) are every optimizer's.

`--also 'NAME=OVERRIDES'` (repeatable) adds a contender built from space-separated overrides, e.g. another
implementation of an optimizer under the same settings. `--profile NAME` also breaks NAME's `optimizer.step`
down by operator (torch.profiler, self CPU time per step): where an optimizer's cost is arithmetic (matrix
products, decompositions) and where it is dispatch.

The last line: `step_ratio_max=<the largest step time / AdamW's among the new optimizers>`.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from _common import build_data, build_model, compose, describe_machine, headline, interleaved

BASELINE = "adamw"
NEW = ("muon", "soap", "schedulefree_adamw", "schedulefree_sgd")
OTHERS = ("sgd", "lars", "lamb")
BATCH = 64


def tensor_bytes(value) -> int:
    """The bytes of every tensor in an optimizer's state entry (SOAP keeps lists of factors), scalars
    (step counters) left out."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size() if value.numel() > 1 else 0
    if isinstance(value, dict):
        return sum(tensor_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(tensor_bytes(v) for v in value)
    return 0


def contender(overrides: list[str], model_name: str, steps: int, batches: list) -> tuple:
    """A timing function for `interleaved` (returning optimizer steps per second) and the optimizer's state
    bytes per parameter after a few steps."""
    config, _ = compose([f"model={model_name}", *overrides, "trainer.device=cpu"])
    data = build_data(config)
    model, optimizer, loss_fn = build_model(config, data)
    train = getattr(optimizer, "train", None)
    if callable(train):  # schedule-free steps in its train mode (lbt.engine.evaluate.AveragedWeights)
        train()
    timings = {"step": [], "optimizer": []}

    def one_step(inputs: torch.Tensor, labels: torch.Tensor) -> tuple[float, float]:
        started = time.perf_counter()
        loss_fn(model(inputs), labels).backward()
        stepped = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        ended = time.perf_counter()
        return ended - started, ended - stepped

    for inputs, labels in batches[:3]:  # warm: the state exists, SOAP's preconditioner is set up
        one_step(inputs, labels)

    def run() -> float:
        whole = part = 0.0
        for k in range(steps):
            inputs, labels = batches[k % len(batches)]
            step, opt = one_step(inputs, labels)
            whole, part = whole + step, part + opt
        timings["step"].append(whole / steps)
        timings["optimizer"].append(part / steps)
        return steps / whole

    state = sum(tensor_bytes(s) for s in optimizer.state.values())
    params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return run, timings, state / params, params


def profile_step(name: str, overrides: list[str], model_name: str, steps: int, batches: list) -> None:
    """NAME's optimizer.step over `steps` steps under torch.profiler: the operators by self CPU time per step."""
    config, _ = compose([f"model={model_name}", *overrides, "trainer.device=cpu"])
    model, optimizer, loss_fn = build_model(config, build_data(config))
    for inputs, labels in batches[:3]:
        loss_fn(model(inputs), labels).backward()
        optimizer.step()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            optimizer.step()  # the gradients of the last batch: the same work as any step's
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events) / steps / 1e3
    print(f"\n{name}: optimizer.step {total:.2f} ms per step under the profiler, by operator (self CPU, per step):")
    print("| operator | ms per step | calls per step |")
    print("| --- | ---: | ---: |")
    for event in events[:8]:
        print(f"| {event.key} | {event.self_cpu_time_total / steps / 1e3:.3f} | {event.count / steps:.0f} |")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="transformer1d")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--steps", type=int, default=40, help="steps per timed repeat")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--profile", help="an optim to break down by operator after the table (e.g. soap)")
    parser.add_argument("--also", action="append", default=[], metavar="'NAME=OVERRIDES'",
                        help="one more contender: space-separated overrides (repeatable)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    config, _ = compose([f"model={args.model}", "trainer.device=cpu"])
    data = build_data(config)
    generator = torch.Generator().manual_seed(0)
    order = torch.randperm(len(data.train), generator=generator)[:BATCH * 8]
    batches = [(torch.stack([data.train[int(i)][0] for i in order[k:k + BATCH]]),
                torch.tensor([int(data.train[int(i)][1]) for i in order[k:k + BATCH]]))
               for k in range(0, len(order), BATCH)]
    contenders = {name: [f"optim={name}"] for name in (BASELINE, *NEW, *OTHERS)}
    for also in args.also:
        name, _, overrides = also.partition("=")
        if not overrides or name in contenders:
            parser.error(f"--also {also!r}: give a new NAME=OVERRIDES, e.g. 'soap_x=optim=soap optim.lr=0.01'")
        contenders[name] = overrides.split()
    if args.profile and args.profile not in contenders:
        parser.error(f"--profile {args.profile}: not one of {', '.join(contenders)}")
    built = {name: contender(overrides, args.model, args.steps, batches) for name, overrides in contenders.items()}
    print(f"{describe_machine()}; model={args.model} ({next(iter(built.values()))[3]:,} parameters), batch {BATCH}, "
          f"{args.threads} thread(s), {args.repeats} repeats x {args.steps} steps")
    interleaved({name: b[0] for name, b in built.items()}, args.repeats)
    base = statistics.median(built[BASELINE][1]["step"])
    base_opt = statistics.median(built[BASELINE][1]["optimizer"])
    print("| optim | step (ms) | x AdamW | optimizer.step (ms) | x AdamW's | state bytes / parameter |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    ratios = {}
    for name, (_, timings, per_param, _) in built.items():
        step, opt = statistics.median(timings["step"]), statistics.median(timings["optimizer"])
        ratios[name] = step / base
        low, high = 1e3 * min(timings["step"]), 1e3 * max(timings["step"])
        print(f"| {name} | {1e3 * step:.2f} ({low:.2f}-{high:.2f}) | {step / base:.2f} | "
              f"{1e3 * opt:.3f} | {opt / base_opt:.2f} | {per_param:.1f} |")
    if args.profile:
        profile_step(args.profile, contenders[args.profile], args.model, args.steps, batches)
    for name in NEW:
        headline(f"step_ratio_{name}", f"{ratios[name]:.3f}")
    headline("step_ratio_max", f"{max(ratios[n] for n in NEW):.3f}")


if __name__ == "__main__":
    main()
