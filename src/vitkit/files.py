"""File modes for what vitkit writes through temporary files (checkpoints, downloads) and safetensors files."""

from __future__ import annotations

import os


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
