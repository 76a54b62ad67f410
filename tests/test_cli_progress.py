"""`vitkit train` and `vitkit eval` draw their progress bars on stderr only where stderr is a terminal, as
`vitkit predict` does: a log file gets no carriage-return frames. `--progress` draws one anywhere,
`--no-progress` nowhere."""

from __future__ import annotations

import io
import sys

import pytest

from train_helpers import fake_data_overrides, write_fake_fashion_mnist
from vitkit.cli.main import main


class Terminal(io.StringIO):
    """A stderr that says it is a terminal."""

    def isatty(self) -> bool:
        return True


def cli(*args) -> int:
    try:
        main([str(a) for a in args])
    except SystemExit as e:
        return e.code or 0
    return 0


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_fake_fashion_mnist(tmp_path_factory.mktemp("data"), n_train=64, n_test=32)


def train_args(data, out, *extra):
    settings = fake_data_overrides(data) + ["steps=4", "batch_size=16", "threads=1", "eval_every=2",
                                            "ckpt_every=4", "log_every=2"]
    return ["train", "demo-tiny", "--out", out, *(a for s in settings for a in ("--set", s)), *extra]


def test_train_draws_its_bar_only_on_a_terminal_unless_told(data, tmp_path, capsys, monkeypatch):
    assert cli(*train_args(data, tmp_path / "log")) == 0
    captured = capsys.readouterr()
    assert "\r" not in captured.err and "\r" not in captured.out
    assert "step 2/4" in captured.out and "step 4/4" in captured.out  # the evaluations, printed plainly

    assert cli(*train_args(data, tmp_path / "forced", "--progress")) == 0
    err = capsys.readouterr().err
    assert "\r" in err and "demo-tiny" in err and "4/4" in err

    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert cli(*train_args(data, tmp_path / "terminal")) == 0
    assert "\r" in terminal.getvalue() and "4/4" in terminal.getvalue()

    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert cli(*train_args(data, tmp_path / "off", "--no-progress")) == 0
    assert "\r" not in terminal.getvalue()


def test_eval_draws_its_bar_only_on_a_terminal_unless_told(data, tmp_path, capsys, monkeypatch):
    assert cli(*train_args(data, tmp_path / "run", "--no-progress")) == 0
    capsys.readouterr()
    args = ["eval", tmp_path / "run" / "last", "--data", "fashion-mnist", "--data-dir", data, "--batch-size",
            "8", "--no-fast", "--device", "cpu", "--out", tmp_path / "eval"]
    assert cli(*args) == 0
    captured = capsys.readouterr()
    assert "\r" not in captured.err and "top-1" in captured.out

    assert cli(*args, "--progress") == 0
    err = capsys.readouterr().err
    assert "\r" in err and "eval" in err and "/4 " in err  # 32 images in batches of 8

    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert cli(*args) == 0
    assert "\r" in terminal.getvalue() and "/4 " in terminal.getvalue()

    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert cli(*args, "--no-progress") == 0
    assert "\r" not in terminal.getvalue()
