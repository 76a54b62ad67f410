"""Where the named datasets are looked for and downloaded to, in order: the `data_dir` argument, `$VITKIT_DATA`,
`~/.cache/vitkit`, and `/usr/share/datasets` (Debian's dataset-fashion-mnist installs
`/usr/share/datasets/fashion-mnist`). In each place the files may lie directly or in the dataset's own sub-folder
(`fashion-mnist/`, `cifar-10-batches-bin/`, `cifar-100-binary/`, ...).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from pathlib import Path

DATA_ENV = "VITKIT_DATA"
SYSTEM_DATA_DIRS: tuple[Path, ...] = (Path("/usr/share/datasets"),)  # Debian's dataset-* packages
SPLITS = ("train", "test")


def cache_dir() -> Path:
    """vitkit's own data cache, `~/.cache/vitkit`."""
    return Path.home() / ".cache" / "vitkit"


def data_roots(data_dir: str | os.PathLike[str] | None = None) -> list[Path]:
    """The places a dataset is looked for, in order: `data_dir`, `$VITKIT_DATA`, `~/.cache/vitkit`, then the
    system's dataset folders."""
    roots = []
    if data_dir is not None:
        roots.append(Path(data_dir).expanduser())
    if os.environ.get(DATA_ENV):
        roots.append(Path(os.environ[DATA_ENV]).expanduser())
    roots.append(cache_dir())
    roots.extend(SYSTEM_DATA_DIRS)
    return roots


def download_root(data_dir: str | os.PathLike[str] | None = None) -> Path:
    """Where a download goes: `data_dir`, else `$VITKIT_DATA`, else `~/.cache/vitkit`."""
    if data_dir is not None:
        return Path(data_dir).expanduser()
    if os.environ.get(DATA_ENV):
        return Path(os.environ[DATA_ENV]).expanduser()
    return cache_dir()


def candidate_folders(roots: Sequence[Path], subfolders: Sequence[str]) -> list[Path]:
    """Each root itself, then each of the dataset's usual sub-folders of it."""
    out = []
    for root in roots:
        out.append(root)
        out.extend(root / sub for sub in subfolders)
    return out


def warn_if_passed_over(data_dir, subfolders: Sequence[str], needed: Sequence[Sequence[str]], used: Path,
                         what: str) -> None:
    """Warn when the files were taken from `used` although `data_dir` was given: which of them `data_dir` (or
    the one of its dataset sub-folders that has the most of them) lacks. `needed` holds, for each file, the
    names it may have (e.g. with and without .gz)."""
    if data_dir is None:
        return
    given = candidate_folders([Path(data_dir).expanduser()], subfolders)
    if used in given:
        return
    have = [[any((folder / name).is_file() for name in names) for names in needed] for folder in given]
    best = max(range(len(given)), key=lambda i: sum(have[i]))  # the first of the fullest
    missing = [" or ".join(names) for names, ok in zip(needed, have[best], strict=True) if not ok]
    if any(have[best]):
        lacks = f"{given[best]} lacks {', '.join(missing)}"
    elif not given[0].is_dir():
        lacks = f"data_dir {given[0]} does not exist"
    else:
        lacks = (f"{given[0]} (nor its {', '.join(subfolders)} sub-folders) has none of its files "
                 f"({', '.join(missing)})")
    warnings.warn(f"{what}: {lacks}; using {used} instead", UserWarning, stacklevel=3)


def check_split(split: str, name: str) -> str:
    # The named datasets have no validation split; their test split serves for evaluation.
    split = {"val": "test", "valid": "test", "validation": "test"}.get(split, split)
    if split not in SPLITS:
        raise ValueError(f"{name} has no split {split!r}; choose from train, test (val means test)")
    return split
