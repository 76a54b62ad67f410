"""The optional parts of vitkit and the extras that install them (`pip install 'vitkit[figures]'`).

The core install carries what the model, loading, saving and training need. Figures (matplotlib), TensorBoard
events, the linear probe's scikit-learn and the build tool of vitkit's compiled CPU operators (ninja) are
extras: a feature that needs one that is missing says so in one line that names the extra (`require`); a
training run, which has them only as side outputs, goes on without them and says what it skipped once
(`available`)."""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

# module -> (the distribution pip installs, the extra that brings it)
EXTRAS = {
    "matplotlib": ("matplotlib", "figures"),
    "tensorboard": ("tensorboard", "tensorboard"),
    "sklearn": ("scikit-learn", "sklearn"),
    "ninja": ("ninja", "kernels"),
    # the inference runtimes `vitkit bench` compares with (benchmarks only)
    "onnxscript": ("onnxscript", "bench-runtimes"),
    "onnxruntime": ("onnxruntime", "bench-runtimes"),
    "openvino": ("openvino", "bench-runtimes"),
    "nncf": ("nncf", "bench-runtimes"),
}


class MissingExtra(ImportError):
    """A feature needs a package of an extra that is not installed; the message names the extra."""


def pip_command(module: str) -> str:
    """The install command of the extra that brings `module`."""
    return f"pip install 'vitkit[{EXTRAS[module][1]}]' (or vitkit[all])"


def install_hint(module: str) -> str:
    """"PACKAGE is not installed: pip install ...", for a warning about what was skipped."""
    return f"{EXTRAS[module][0]} is not installed: {pip_command(module)}"


def available(module: str) -> bool:
    """Whether `module` (a key of EXTRAS) can be imported here."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a module entry set to None (as tests do) or a broken one
        return False


def require(module: str, feature: str) -> ModuleType:
    """`module` imported, or MissingExtra: "FEATURE needs PACKAGE: pip install 'vitkit[EXTRA]'"."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise MissingExtra(f"{feature} needs {EXTRAS[module][0]}: {pip_command(module)}") from None
