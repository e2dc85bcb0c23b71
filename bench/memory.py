"""Peak memory per rank, replicated (DDP) vs sharded (dist.shard=fsdp), measured against lbt plan's prediction.

    python bench/memory.py [--layers 8] [--width 1024] [--steps 3]

Trains `model=gpt` (the largest that runs on this machine's 24 GiB at 4 processes replicated: 8 blocks of
width 1024, about 101M parameters) with AdamW on byte tokens for a few steps, with `lbt train` as a
subprocess at 1, 2 and 4 processes, each replicated and (at 2 and 4) sharded. A rank's peak is the
largest VmHWM (peak resident set) among the run's processes, sampled from /proc while it runs. The
runs take MALLOC_MMAP_THRESHOLD_=65536, so glibc returns a freed tensor's memory to the system at once
and the peak resident set follows the live tensors, as a GPU allocator's peak allocated does (with
glibc's default, freed temporaries under 32 MB stay in the heap: +300 MiB per rank here). The
same run with a two-block width-16 GPT gives what does not grow with the model (torch, gloo, data,
the run's bookkeeping); the model's share is the difference. Predicted: lbt/cost/memory.py
(`lbt plan`'s memory line): parameters, gradients and AdamW's two state tensors in fp32 (and DDP's
gradient buckets from 2 processes on), over D when sharded, plus four of the largest block (its docstring
says why). Activations are measured, not predicted.
Last line: fsdp_ddp_ratio_4=<sharded / replicated model memory per rank at 4 processes>.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from lbt.cost.memory import OPTIMIZER_SLOTS, ModelMemory
from lbt.data.tokens import write_byte_tokens
from lbt.models.gpt import GPT
from lbt.parallel.fsdp import shard_units

CONTEXT = 64


def descendants(pid: int) -> list[int]:
    found = [pid]
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            for child in (task / "children").read_text().split():
                found += descendants(int(child))
    except FileNotFoundError:
        pass
    return found


def peak_bytes(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except FileNotFoundError:
        pass
    return 0


def run_peak(tokens: Path, layers: int, width: int, heads: int, procs: int, shard: str, steps: int) -> int:
    """The largest peak resident set among the run's processes (the launcher's is the smallest), bytes."""
    with tempfile.TemporaryDirectory() as run_dir:
        command = [sys.executable, "-m", "lbt", "train", "data=tokens", f"data.path={tokens}",
                   f"data.context={CONTEXT}", "data.eval_windows=16", "model=gpt", f"model.n_layer={layers}",
                   f"model.n_embd={width}", f"model.n_head={heads}", "optim=adamw", "optim.fused=false",
                   "trainer.per_worker_batch=2", f"dist.world_size={procs}", f"dist.procs={procs}",
                   f"dist.shard={shard}", "dist.allow_oversubscribe=true", f"trainer.max_steps={steps}",
                   "trainer.evals=0", "trainer.progress=false", "trainer.checkpoint_every=0",
                   f"hydra.run.dir={run_dir}"]
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
        job = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
        peaks: dict[int, int] = {}
        while job.poll() is None:
            for pid in descendants(job.pid):
                peaks[pid] = max(peaks.get(pid, 0), peak_bytes(pid))
            time.sleep(0.05)
        if job.returncode != 0:
            sys.exit(f"the run failed (exit {job.returncode}): {job.stderr.read()[-2000:]}")
    return max(peaks.values())


def predicted(layers: int, width: int, heads: int, procs: int, shard: str) -> float:
    model = GPT(input_shape=(CONTEXT,), num_classes=256, n_layer=layers, n_head=heads, n_embd=width)
    params = sum(p.numel() for p in model.parameters())
    largest = max(sum(p.numel() for p in block.parameters()) for _, block in shard_units(model))
    memory = ModelMemory(params, largest, OPTIMIZER_SLOTS["adamw"])
    return memory.per_rank(procs) if shard == "fsdp" else memory.replicated(procs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--steps", type=int, default=3)
    options = parser.parse_args()
    os.environ["LBT_ALLOW_OVERSUBSCRIBE"] = "1"
    with tempfile.TemporaryDirectory() as folder:
        text = Path(folder) / "text.bin"
        text.write_bytes(os.urandom(400_000))
        tokens = Path(folder) / "tokens"
        write_byte_tokens(str(text), str(tokens))
        rows, model_memory = [], {}
        print("| layout | processes | peak per rank | small model's | model's share | predicted | measured / "
              "predicted |\n| --- | ---: | ---: | ---: | ---: | ---: | ---: |", flush=True)
        for procs, shard in ((1, "none"), (2, "none"), (2, "fsdp"), (4, "none"), (4, "fsdp")):
            big = run_peak(tokens, options.layers, options.width, options.heads, procs, shard, options.steps)
            small = run_peak(tokens, 2, 16, 2, procs, shard, options.steps)
            share = big - small
            guess = predicted(options.layers, options.width, options.heads, procs, shard)
            model_memory[(procs, shard)] = share
            name = "sharded (fsdp)" if shard == "fsdp" else "replicated (DDP)" if procs > 1 else "one process"
            rows.append(f"| {name} | {procs} | {big / 2**20:,.0f} MiB | {small / 2**20:,.0f} MiB | "
                        f"{share / 2**20:,.0f} MiB | {guess / 2**20:,.0f} MiB | {share / guess:.2f} |")
            print(rows[-1], flush=True)
    ratio = model_memory[(4, "fsdp")] / model_memory[(4, "none")]
    print(f"model: gpt n_layer={options.layers} n_embd={options.width}, AdamW, per_worker_batch 2 x {CONTEXT} tokens")
    print(f"fsdp_ddp_ratio_4={ratio:.3f}")


if __name__ == "__main__":
    main()
