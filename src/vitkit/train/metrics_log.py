"""A run's metrics, written as it trains: RUN/metrics.csv and TensorBoard's RUN/tb."""

from __future__ import annotations

import csv
import time
import warnings
from pathlib import Path

from ..extras import available, install_hint
from ..files import atomic_write


class MetricsLog:
    """Metrics to RUN/metrics.csv and TensorBoard (RUN/tb); only the main process writes."""

    COLUMNS = ("time", "step", "epoch", "split", "loss", "lr", "img_per_s", "top1", "top5", "skipped_steps")
    REQUIRED = COLUMNS[:4]  # every row has these (a file written before a column was added lacks it)

    def __init__(self, run_dir: Path, enabled: bool, resume_step: int):
        self.enabled = enabled
        self.path = run_dir / "metrics.csv"
        self.tb = None
        if not enabled:
            return
        if resume_step and self.path.is_file():
            # Rows a killed run wrote after its last checkpoint are replayed by the resumed run: drop them.
            self._rewrite([r for r in self.read_rows(self.path) if int(r["step"]) <= resume_step])
        elif not self.path.is_file() or not resume_step:
            self._rewrite([])
        if not available("tensorboard"):  # a side output: the run goes on without it
            warnings.warn(f"TensorBoard events not written (tb/): {install_hint('tensorboard')}",
                          RuntimeWarning, stacklevel=2)
            return
        from torch.utils.tensorboard import SummaryWriter

        # Events after the checkpoint a run resumes from are replayed: purge them (the checkpoint's own step
        # stays).
        self.tb = SummaryWriter(str(run_dir / "tb"), purge_step=resume_step + 1 if resume_step else None)

    @classmethod
    def read_rows(cls, path: Path) -> list[dict[str, str]]:
        """The complete rows of a metrics.csv: a row a kill cut short (the file's last line, without its
        newline) or one that is not a row of these columns is left out."""
        text = path.read_text(errors="replace")
        if not text.endswith("\n"):
            text = text[:text.rfind("\n") + 1]
        rows = []
        for r in csv.DictReader(text.splitlines(), restkey="_extra"):
            if "_extra" in r or any(r.get(c) is None for c in cls.REQUIRED):
                continue
            try:
                int(r["step"])
            except ValueError:
                continue
            rows.append(r)
        return rows

    def _rewrite(self, rows: list[dict]) -> None:
        def write(tmp: str) -> None:
            with open(tmp, "w", newline="") as f:
                w = csv.DictWriter(f, fieldnames=self.COLUMNS)
                w.writeheader()
                w.writerows(rows)

        atomic_write(self.path, write)

    def write(self, step: int, epoch: float, split: str, **values: float | None) -> None:
        """One row; a None value (top-5 of 5 classes or fewer) leaves its cell empty and draws no point."""
        if not self.enabled:
            return
        values = {k: v for k, v in values.items() if v is not None}
        row = {"time": f"{time.time():.1f}", "step": step, "epoch": f"{epoch:.4f}", "split": split}
        row.update({k: f"{v:.6g}" for k, v in values.items()})
        with self.path.open("a", newline="") as f:
            csv.DictWriter(f, fieldnames=self.COLUMNS).writerow(row)
        for k, v in values.items():
            if self.tb is not None:
                self.tb.add_scalar(f"{split}/{k}", v, step)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
