"""Downloading a dataset file: streamed over HTTP(S) with a progress bar, checked against its published MD5,
and written atomically (a temporary file in the target folder, renamed into place only once it is complete
and verified), so that an interrupted or corrupted download never leaves a file that looks finished."""

from __future__ import annotations

import hashlib
import os
import tempfile
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from tqdm import tqdm

from ..files import permit_as_created

CHUNK_BYTES = 1 << 20  # read 1 MiB at a time
TIMEOUT_S = 60.0  # per socket operation, not for the whole file


class DownloadError(ValueError):
    """A download failed or its content does not match the published checksum. A ValueError so that the
    command line prints it as one line; the message names the URL or the file."""



def download_file(url: str, dest: str | os.PathLike[str], md5: str | None = None,
                  progress: bool = True) -> Path:
    """Download `url` to `dest` and return `dest`.

    With `md5`, the downloaded bytes must have that digest, else DownloadError names the file and both digests
    and nothing is written to `dest`. The bytes go to a temporary file beside `dest` first and are renamed
    into place (`os.replace`, atomic on one file system) only after the check.
    """
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".part", dir=dest.parent)
    tmp = Path(tmp_name)
    permit_as_created(tmp)  # a dataset cache is shared like any file
    try:
        digest = hashlib.md5()
        with os.fdopen(fd, "wb") as out:
            try:
                with urllib.request.urlopen(url, timeout=TIMEOUT_S) as response:
                    length = response.headers.get("Content-Length")
                    total = int(length) if length and length.isdigit() else None
                    with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=dest.name,
                              disable=not progress, leave=False) as bar:
                        for chunk in iter(lambda: response.read(CHUNK_BYTES), b""):
                            out.write(chunk)
                            digest.update(chunk)
                            bar.update(len(chunk))
            except (urllib.error.URLError, OSError) as e:
                reason = getattr(e, "reason", None) or e
                raise DownloadError(f"downloading {url} failed: {reason}") from e
            out.flush()
            os.fsync(out.fileno())
        got = digest.hexdigest()
        if md5 is not None and got != md5.lower():
            raise DownloadError(
                f"{dest.name} downloaded from {url} has MD5 {got}, expected {md5.lower()}: "
                "the file is corrupt or not the published one; nothing was saved"
            )
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
    return dest


T = TypeVar("T")


def found_or_downloaded(found: T | None, missing: str, download: bool, fetch: Callable[[], T],
                        by_hand: str) -> T:
    """What a dataset's search `found`, else (with `download`) what `fetch()` downloads. `missing` says what
    was looked for and where; the error without download adds how to get the files `by_hand`, a failed
    download adds its own reason."""
    if found is not None:
        return found
    if not download:
        raise FileNotFoundError(f"{missing}; allow the download, or {by_hand}")
    try:
        return fetch()
    except DownloadError as e:
        raise DownloadError(f"{missing}, and {e}") from e
