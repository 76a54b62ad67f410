"""The optional parts of vitkit and the extras that install them (`pip install 'vitkit[figures]'`).

The core install carries what the model, loading, saving and training need. Figures (matplotlib), TensorBoard
events, the linear probe's scikit-learn, the build tool of vitkit's compiled CPU operators (ninja) and
OpenVINO with the ONNX exporter (`vitkit export --to openvino`) are extras: a feature that needs one that is
missing says so in one line that names the extra (`require`); a training run, which has them only as side
outputs, goes on without them and says what it skipped once (`available`)."""

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
    "onnx": ("onnx", "bench-runtimes"),
}
# the extras that `pip install 'vitkit[all]'` brings (pyproject.toml)
IN_ALL = ("figures", "tensorboard", "sklearn", "kernels", "serve", "data")


class MissingExtra(ImportError):
    """A feature needs a package of an extra that is not installed; the message names the extra."""


def pip_command(module: str, extra: str | None = None) -> str:
    """The install command of `extra`, by default the extra of EXTRAS that brings `module`."""
    extra = extra or EXTRAS[module][1]
    return f"pip install 'vitkit[{extra}]'" + (" (or vitkit[all])" if extra in IN_ALL else "")


def install_hint(module: str) -> str:
    """"PACKAGE is not installed: pip install ...", for a warning about what was skipped."""
    return f"{EXTRAS[module][0]} is not installed: {pip_command(module)}"


def available(module: str) -> bool:
    """Whether `module` (a key of EXTRAS) can be imported here."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a module entry set to None (as tests do) or a broken one
        return False


def require(module: str, feature: str, extra: str | None = None) -> ModuleType:
    """`module` imported, or MissingExtra: "FEATURE needs PACKAGE: pip install 'vitkit[EXTRA]'". `extra`:
    the one to name where the feature's own extra is not the one EXTRAS lists (a package of two extras)."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise MissingExtra(f"{feature} needs {EXTRAS[module][0]}: {pip_command(module, extra)}") from None
