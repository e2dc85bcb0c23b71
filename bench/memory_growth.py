"""No memory growth over a long run: RSS after epoch 1 vs the rest of a 30-epoch run.

    python bench/memory_growth.py [--quick] [--epochs 30] [--procs 2]

Runs `lbt train` on synthetic data as a subprocess (W=4 workers on --procs
processes, gradient noise scale on), samples the resident set size of it and
its worker processes from /proc after every epoch line it prints, and reports the growth from
the end of epoch 1 to the largest later value. Last line: rss_growth=<fraction>.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path


def rss_bytes(pid: int) -> int:
    """Resident set size of `pid` and all its descendants (the launcher and its worker processes)."""
    total = 0
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                total += int(line.split()[1]) * 1024
        for task in Path(f"/proc/{pid}/task").iterdir():
            for child in (task / "children").read_text().split():
                total += rss_bytes(int(child))
    except FileNotFoundError:  # a process that just ended
        pass
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--quick", action="store_true", help="10 epochs of a smaller set")
    parser.add_argument("--procs", type=int, default=1, help="real processes (their RSS is summed); default 1")
    options = parser.parse_args()
    epochs = 10 if options.quick else options.epochs
    samples = 2048 if options.quick else 8192
    with tempfile.TemporaryDirectory() as run_dir:
        command = [sys.executable, "-m", "lbt", "train", "data=synthetic", f"data.num_train={samples}",
                   "model=cnn1d", f"trainer.epochs={epochs}", "trainer.progress=false", "dist.world_size=4",
                   f"dist.procs={options.procs}",
                   "measure=[gns]", f"hydra.run.dir={run_dir}"]
        job = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
        per_epoch = []
        for line in job.stdout:
            if line.startswith("epoch "):
                per_epoch.append(rss_bytes(job.pid))
                print(f"{line.split(' train_loss')[0]}: RSS {per_epoch[-1] / 2**20:.1f} MiB", flush=True)
        if job.wait() != 0 or len(per_epoch) < 2:
            sys.exit(f"the run failed (exit {job.returncode})")
    growth = max(per_epoch[1:]) / per_epoch[0] - 1
    print(f"RSS after epoch 1: {per_epoch[0] / 2**20:.1f} MiB; largest later: {max(per_epoch[1:]) / 2**20:.1f} MiB")
    print(f"rss_growth={growth:.4f}")


if __name__ == "__main__":
    main()
