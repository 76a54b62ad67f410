"""What a run reports as it trains: the progress bar on stderr, the rows of RUN/metrics.csv and TensorBoard's
events (vitkit.train.metrics_log), and messages, written through the bar."""

from __future__ import annotations

import time

from .metrics_log import MetricsLog

LINE_EVERY_S = 10.0


def progress_bar(run, progress: bool | None):
    """The main process's progress bar on stderr for `run` (a vitkit.train.loop.Run), or None: always with
    `progress` True, never with False, and with None only where stderr is a terminal (a log file would keep
    every frame the bar draws)."""
    if progress is False or not run.ctx.is_main:
        return None
    from tqdm import tqdm

    bar = tqdm(total=run.lengths.total, initial=run.step, desc=run.cfg.recipe or "train", unit="step",
               dynamic_ncols=True, mininterval=1.0, disable=None if progress is None else False)
    return None if bar.disable else bar


class Report:
    """What a run reports as it trains: the rows of RUN/metrics.csv (`log`), the progress bar (`bar`, or None)
    and messages, written through the bar, which lifts itself first, when there is one."""

    def __init__(self, log: MetricsLog, bar, lines: bool = False):
        """`lines`: without a bar (stderr is no terminal: a log file, a scheduler's job), print a line of the
        same figures at the logging steps, at most one every LINE_EVERY_S seconds, and at the last step."""
        self.log, self.bar, self.lines = log, bar, lines and bar is None
        self.window_t, self.window_n, self.loss_ema = time.time(), 0, None  # throughput window, smoothed loss
        self.line_t = time.time()

    def print(self, message: str) -> None:
        (self.bar.write if self.bar else print)(message)

    def after_step(self, run, lr: float, loss: float | None) -> None:
        """The bar moves on; every `log_every` steps and at the last (the steps with a `loss`), a row of the
        loss, the learning rate, the images per second since the last row and the steps skipped so far."""
        self.window_n += run.cfg.batch_size
        if self.bar is not None:
            self.bar.update(1)
        if loss is not None:
            self.loss_ema = loss if self.loss_ema is None else 0.9 * self.loss_ema + 0.1 * loss
            ips = self.window_n / max(time.time() - self.window_t, 1e-9)
            self.window_t, self.window_n = time.time(), 0
            epoch = run.step / run.lengths.per_epoch
            self.log.write(run.step, epoch, "train", loss=loss, lr=lr, img_per_s=ips,
                           skipped_steps=run.skipped)
            if self.bar is not None:
                self.bar.set_postfix(loss=f"{self.loss_ema:.4f}", lr=f"{lr:.2e}", img_s=f"{ips:.0f}",
                                     epoch=f"{epoch:.2f}")
            last = run.step == run.lengths.total
            if self.lines and (last or time.time() - self.line_t >= LINE_EVERY_S):
                self.line_t = time.time()
                print(f"step {run.step}/{run.lengths.total} (epoch {epoch:.2f}): loss {self.loss_ema:.4f}, "
                      f"lr {lr:.2e}, {ips:.0f} images/s", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        self.log.close()
