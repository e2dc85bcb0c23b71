"""lbt's training speed against PyTorch Lightning's Trainer (target: ratio >= 1.0).

    pip install lightning                 # bench-only: not a dependency of lbt
    python bench/peers.py                 # full: 7 interleaved repeats per model
    python bench/peers.py --quick         # under 2 minutes
    python bench/peers.py --per-sample-loader   # also Lightning with the usual per-sample DataLoader

The same training on both sides: the model and SGD built from the same
composed lbt config, batch 64, world_size 1, the same number of steps, the
same torch.set_num_threads, data in memory.
- lbt: `lbt.engine.run` (samples_per_sec: training steps only).
- Lightning: `lightning.Trainer(accelerator="cpu", devices=1, max_steps=S, max_epochs=-1)`
  fitting a LightningModule whose training_step returns the cross-entropy
  (automatic optimization), with logging, checkpointing, progress bar and
  model summary off, and the fastest in-memory loader we could give it: a
  DataLoader yielding whole batches (BatchSampler over a RandomSampler,
  batch_size=None, each batch one index of the TensorDataset). Its time runs
  from the first on_train_epoch_start to the last on_train_batch_end (a Callback).
Warm-up is excluded (one unmeasured run of each side first); the two alternate
(ABBA) inside one loop of repeats. The last line is
`lightning_ratio=<worst model's median of per-repeat lbt / Lightning>`.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
import warnings

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
    pair_ratios,
    spread,
)
from overhead import LbtRun


def import_lightning():
    try:
        import lightning
    except ImportError as error:
        print(f"peers: error: PyTorch Lightning is not installed ({error}).\n"
              "Install it into this environment first: pip install lightning  "
              "(a bench-only extra, not a dependency of lbt). No comparison was made.", file=sys.stderr)
        sys.exit(1)
    return lightning


class LightningRun:
    def __init__(self, case: Case, steps: int, threads: int, per_sample: bool = False):
        self.lightning = import_lightning()
        self.steps, self.threads, self.batch, self.per_sample = steps, threads, case.batch, per_sample
        self.config, _ = compose(case.lbt_overrides(steps))
        self.data = build_data(self.config)

    def loader(self):
        from torch.utils.data import BatchSampler, DataLoader, RandomSampler, TensorDataset

        dataset = TensorDataset(self.data.train.x, self.data.train.y)
        generator = torch.Generator().manual_seed(0)
        if self.per_sample:  # what most Lightning code does: per-sample fetch + default_collate
            return DataLoader(dataset, batch_size=self.batch, shuffle=True, drop_last=True, generator=generator)
        batches = BatchSampler(RandomSampler(dataset, generator=generator), self.batch, drop_last=True)
        return DataLoader(dataset, sampler=batches, batch_size=None)

    def __call__(self) -> float:
        L = self.lightning
        model, optimizer, loss_fn = build_model(self.config, self.data)

        class Module(L.LightningModule):
            def __init__(self):
                super().__init__()
                self.model = model

            def training_step(self, batch, batch_idx):
                inputs, labels = batch
                return loss_fn(self.model(inputs), labels)

            def configure_optimizers(self):
                return optimizer

        class Timer(L.Callback):
            start = end = None
            threads = None

            def on_train_epoch_start(self, trainer, pl_module):
                if self.start is None:  # the first epoch's start: a run of S steps spans several epochs
                    self.start = time.perf_counter()
                    self.threads = torch.get_num_threads()

            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
                self.end = time.perf_counter()

        timer = Timer()
        # max_epochs=-1: stop at max_steps only, across as many epochs as that takes (cnn1d's 2,500 steps of 64
        # are 3 epochs of MNIST-1D's 54,000 training samples), as lbt's side does with trainer.max_steps.
        trainer = L.Trainer(
            accelerator="cpu", devices=1, max_steps=self.steps, max_epochs=-1, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            num_sanity_val_steps=0, limit_val_batches=0, callbacks=[timer], deterministic=False,
        )
        torch.set_num_threads(self.threads)
        trainer.fit(Module(), train_dataloaders=self.loader())
        if trainer.global_step != self.steps:
            raise RuntimeError(f"Lightning ran {trainer.global_step} steps, expected {self.steps}")
        if timer.threads != self.threads:
            raise RuntimeError(f"Lightning trained with {timer.threads} threads, expected {self.threads}")
        return self.steps * self.batch / (timer.end - timer.start)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="3 repeats and fewer steps (under 2 minutes)")
    parser.add_argument("--repeats", type=int, help="interleaved repeats per model (default 7, quick 3)")
    parser.add_argument("--models", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads on both sides (default 1: see bench/README.md, ## Speed)")
    parser.add_argument("--per-sample-loader", action="store_true",
                        help="also time Lightning with a per-sample DataLoader(shuffle=True), the common setup")
    args = parser.parse_args(argv)
    L = import_lightning()
    warnings.filterwarnings("ignore")  # Lightning's advice about DataLoader workers and the like
    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "pytorch_lightning"):
        logging.getLogger(name).setLevel(logging.ERROR)
    repeats = args.repeats or (3 if args.quick else 7)
    print(describe_machine(), flush=True)
    print(f"lightning {L.__version__}", flush=True)
    watch = LoadWatch(own=args.threads)
    ratios: dict[str, float] = {}
    rows = []
    for name in args.models:
        case = CASES[name]
        steps = case.quick_steps if args.quick else case.steps
        contenders = {"lightning": LightningRun(case, steps, args.threads), "lbt": LbtRun(case, steps, args.threads)}
        if args.per_sample_loader:
            contenders["lightning per-sample"] = LightningRun(case, steps, args.threads, per_sample=True)
        warm = max(2, steps // 10)
        LightningRun(case, warm, args.threads)(), LbtRun(case, warm, args.threads)()
        print(f"{name}: {steps} steps of batch {case.batch}, {repeats} interleaved repeats ...", flush=True)
        values = interleaved(contenders, repeats, watch)
        per_pair = pair_ratios(values["lbt"], values["lightning"])
        ratios[name] = median(per_pair)
        rows.append((name, steps, values, per_pair))
        print(f"  lightning {spread(values['lightning'])} | lbt {spread(values['lbt'])} samples/s | "
              f"lbt/lightning per repeat: {', '.join(f'{r:.3f}' for r in per_pair)}", flush=True)
    print()
    extra = " Lightning per-sample loader |" if args.per_sample_loader else ""
    print(f"| model | batch | steps | threads | Lightning samples/s |{extra} lbt samples/s | lbt / Lightning |")
    print("| --- | --- | --- | --- | --- |" + (" --- |" if extra else "") + " --- | --- |")
    for name, steps, values, per_pair in rows:
        cell = f" {spread(values['lightning per-sample'])} |" if extra else ""
        print(f"| {name} | {CASES[name].batch} | {steps} | {args.threads} | {spread(values['lightning'])} |{cell} "
              f"{spread(values['lbt'])} | {median(per_pair):.3f} (min {min(per_pair):.3f}, max {max(per_pair):.3f}) |")
    print("(samples/s: median (min-max, n); lbt / Lightning: median of the per-repeat ratios)")
    print(watch.verdict())
    worst = min(ratios, key=ratios.get)
    print(f"worst: {worst} ({ratios[worst]:.3f}); target >= 1.0: {'met' if ratios[worst] >= 1.0 else 'MISSED'}")
    headline("lightning_ratio", ratios[worst])
    return 0


if __name__ == "__main__":
    sys.exit(main())
