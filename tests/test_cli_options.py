"""The commands' numeric options refuse values out of range before any work, naming the option: a batch size
of 0 used to end `vitkit eval` in a ZeroDivisionError traceback, `--limit -5` evaluated all but the last five
images, and `predict -k 0` printed empty lines."""

from __future__ import annotations

import pytest

from vitkit.cli.main import main

CKPT = "no-such-checkpoint"  # never read: the option fails first

BAD_OPTIONS = [
    (["eval", CKPT, "--data", "fashion-mnist", "--batch-size", "0"], "--batch-size"),
    (["eval", CKPT, "--data", "fashion-mnist", "--limit", "-5"], "--limit"),
    (["predict", CKPT, "x.png", "--top-k", "0"], "--top-k"),
    (["bench", "--repeats", "0"], "--repeats"),
    (["bench", "--warmup", "-1"], "--warmup"),
    (["bench", "--threads", "-2"], "--threads"),
    (["export", CKPT, "m.onnx", "--opset", "-1"], "--opset"),
    (["models", "--classes", "-1"], "--classes"),
    (["convert", CKPT, "out", "--num-heads", "-3"], "--num-heads"),
    (["analyze", "filters", CKPT, "--components", "0"], "--components"),
    (["analyze", "distance", CKPT, "--data", "fashion-mnist", "--batch-size", "0"], "--batch-size"),
    (["fewshot", CKPT, "--data", "fashion-mnist", "--batch-size", "0"], "--batch-size"),
    (["fewshot", CKPT, "--data", "fashion-mnist", "--max-train", "0"], "--max-train"),
    (["probe", CKPT, "--data", "fashion-mnist", "--max-test", "-1"], "--max-test"),
    (["probe", CKPT, "--data", "fashion-mnist", "--max-iter", "0"], "--max-iter"),
]


@pytest.mark.parametrize("argv,option", BAD_OPTIONS, ids=[" ".join(a[:1] + a[-2:]) for a, _ in BAD_OPTIONS])
def test_out_of_range_option_is_a_usage_error(argv, option, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert option in err and "Invalid value" in err and "Traceback" not in err


def test_an_error_names_the_command_whose_help_to_read(tmp_path, capsys):
    (tmp_path / "x.onnx").write_text("")
    with pytest.raises(SystemExit) as e:
        main(["train", "demo-tiny", "--out", str(tmp_path / "x.onnx")])  # a file, not a folder
    assert e.value.code == 1
    err = capsys.readouterr().err
    assert "error: --out" in err and "hint: see `vitkit train --help`" in err


def test_a_full_or_read_only_filesystem_is_one_line(monkeypatch, tmp_path, capsys):
    """Errno 28 (or 30, EROFS) from deep inside a run: the path and errno's words, no traceback."""
    import errno

    import vitkit.train

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "run" / "metrics.csv"))

    monkeypatch.setattr(vitkit.train, "train", full)
    with pytest.raises(SystemExit) as e:
        main(["train", "demo-tiny", "--out", str(tmp_path / "run")])
    assert e.value.code == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: {tmp_path / 'run' / 'metrics.csv'}: No space left on device\nhint: ") and \
        "Traceback" not in err


def test_an_out_folder_that_cannot_be_written_is_refused_before_any_work(monkeypatch, tmp_path):
    import os

    from vitkit.train import run_folder

    monkeypatch.setattr(run_folder.os, "access", lambda path, mode: os.fspath(path) != os.fspath(tmp_path))
    with pytest.raises(ValueError, match=rf"--out {tmp_path / 'run'}: {tmp_path} is not writable"):
        run_folder.check_run_folder(tmp_path / "run", resume=False)


def test_an_unknown_model_is_one_line_but_a_bug_s_key_error_keeps_its_traceback(capsys):
    from vitkit.cli.main import explain

    with pytest.raises(SystemExit) as e:
        main(["bench", "--model", "ViT-Q/16"])
    err = capsys.readouterr().err
    assert e.value.code == 1 and "error: unknown model 'ViT-Q/16'" in err and "vitkit models" in err
    # Any other KeyError is a bug: re-raised, not dressed up as a wrong model name.
    with pytest.raises(KeyError, match="ema_updates"):
        explain(KeyError("ema_updates"), ["train"])
