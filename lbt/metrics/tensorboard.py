"""TensorBoard logging, on the main process only.

Every scalar is written twice: against optimizer steps (`train/loss`) and
against samples seen (`by_samples/train/loss`), so runs with different global
batches line up on the second axis.
"""

from __future__ import annotations

from pathlib import Path

from torch.utils.tensorboard import SummaryWriter
from torch.utils.tensorboard.summary import hparams as hparams_summary


class RunLogger:
    def __init__(self, run_dir: str | Path | None):
        # Non-main processes pass None and log nothing.
        self.writer = SummaryWriter(str(run_dir)) if run_dir is not None else None

    def scalars(self, values: dict[str, float], step: int, samples_seen: int) -> None:
        if self.writer is None:
            return
        for tag, value in values.items():
            self.writer.add_scalar(tag, value, step)
            self.writer.add_scalar(f"by_samples/{tag}", value, samples_seen)

    def hparams(self, params: dict, metrics: dict[str, float]) -> None:
        """One row of TensorBoard's HParams table for this run."""
        if self.writer is None:
            return
        params = {k: (v if isinstance(v, (int, float, str, bool)) else str(v)) for k, v in params.items()}
        experiment, session_start, session_end = hparams_summary(params, metrics)
        file_writer = self.writer._get_file_writer()
        for summary in (experiment, session_start, session_end):
            file_writer.add_summary(summary)
        for tag, value in metrics.items():
            self.writer.add_scalar(tag, value)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.flush()
            self.writer.close()
