"""The package's names load on first use (lazy_loader): `vitkit --help` and a command's help run without torch
(they take seconds when every command's imports load first, about 1 s without), and
every name the packages export still resolves to what it names."""

from __future__ import annotations

import subprocess
import sys
import types

import pytest

NO_TORCH = """
import sys
from vitkit.cli.main import main
try:
    main(sys.argv[1:])
except SystemExit as e:
    assert e.code == 0, e.code
loaded = sorted(m for m in sys.modules if m == "torch" or m.startswith(("torch.", "torchvision")))
assert not loaded, loaded[:5]
"""


@pytest.mark.parametrize("argv", [["--help"], ["train", "--help"], ["analyze", "attention", "--help"],
                                  ["eval", "--help"]], ids=" ".join)
def test_help_does_not_import_torch(argv):
    run = subprocess.run([sys.executable, "-c", NO_TORCH, *argv], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert "Usage: vitkit" in run.stdout


RESOLVE = """
import types
import vitkit.train.loop  # imports the module vitkit.train.evaluate, whose name the function shares
import vitkit, vitkit.data, vitkit.train
for package in (vitkit, vitkit.data, vitkit.train):
    for name in package.__all__:
        value = getattr(package, name)
        assert not isinstance(value, types.ModuleType), (package.__name__, name)
        assert getattr(value, "__name__", name) == name or not callable(value), (package.__name__, name)
from vitkit.train import evaluate
assert callable(evaluate) and not isinstance(evaluate, types.ModuleType)
print(len(vitkit.__all__), len(vitkit.data.__all__), len(vitkit.train.__all__))
"""


def test_every_exported_name_resolves_to_itself():
    run = subprocess.run([sys.executable, "-c", RESOLVE], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["13", "17", "13"]


def test_the_package_names_are_the_modules_objects():
    import vitkit
    from vitkit.cpu.accelerate import accelerate
    from vitkit.model import create_model
    from vitkit.train.evaluate import evaluate

    assert vitkit.create_model is create_model
    # the function, not its module
    assert vitkit.accelerate is accelerate and vitkit.cpu.accelerate is accelerate
    assert vitkit.train.evaluate is evaluate and not isinstance(vitkit.train.evaluate, types.ModuleType)
    assert "create_model" in dir(vitkit)
