"""Writing files safely: through a temporary file renamed into place (a crash never leaves half a file), with
the mode a plain open() would give (checkpoints, model folders, downloads, safetensors files)."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def permit_as_created(path: str | os.PathLike, directory: bool = False) -> None:
    """Give `path` the mode a plain open() or mkdir() would have (0666 or 0777 less the umask). mkstemp and
    mkdtemp make private files (0600) and folders (0700), and a rename keeps that: without this, a checkpoint
    written into a shared folder could be read by no one else."""
    os.chmod(path, (0o777 if directory else 0o666) & ~_umask())


def save_safetensors(tensors: dict, path: str | os.PathLike, metadata: dict[str, str] | None = None) -> None:
    """safetensors' save_file, which creates its file private (0600), with the mode of a plain open()."""
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata=metadata)
    permit_as_created(path)


def atomic_write(path: Path, write: Callable[[str], Any]) -> None:
    """`write(tmp)` to a temporary file in `path`'s folder, then rename it to `path`: a crash never leaves
    half a file, and `path` is either the old file or the new one."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        permit_as_created(tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_model_folder(folder: str | os.PathLike, tensors: dict, tensors_format: str,
                       json_files: dict[str, Any]) -> Path:
    """A model folder: `tensors` as model.safetensors (metadata format=`tensors_format`) and each of
    `json_files` (file name -> data) as indented JSON, every file written atomically. Returns the folder,
    created if need be."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    atomic_write(folder / "model.safetensors",
                 lambda tmp: save_file(tensors, tmp, metadata={"format": tensors_format}))
    for name, data in json_files.items():
        atomic_write(folder / name,
                     lambda tmp, data=data: Path(tmp).write_text(json.dumps(data, indent=2) + "\n"))
    return folder
