"""Running a test's body in a Python process of its own: for what is process-wide and outlives a test, such as
OpenVINO's thread pools and inductor's `freezing` setting, with which a later fork of the test process (a
subprocess test) crashed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def in_child(test_file: str, call: str) -> str:
    """Run `call` (an expression over the names of the test module at `test_file`, its `__file__`) in a fresh
    Python process; its failure fails the calling test, with the end of the child's stderr. Returns the
    child's stdout."""
    module = Path(test_file)
    code = (f"import sys; sys.path.insert(0, {str(module.parent)!r}); import {module.stem} as t; "
            f"t.{call}")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout
