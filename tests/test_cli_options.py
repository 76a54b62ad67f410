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
