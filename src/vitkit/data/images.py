"""Opening an image file safely: every Pillow mode to 'RGB' or 'L', decompression bombs refused, and every way
a file can be bad (corrupt, truncated, empty, not an image, a broken symbolic link) reported as one
`BadImageError` naming the file; the same for an image held in memory (`decode_image`, for uploads). And which
files in a folder are images (`image_files`), for image-folder datasets and `vitkit predict` alike."""

from __future__ import annotations

import errno
import io
import os
import threading
import warnings
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from PIL import Image, ImageFile

# The largest image we decode, Pillow's own default limit: 2**30 // 4 // 3 = 89.5 megapixels (0.25 GiB as
# RGB; a 12000 x 7400 photograph). A header claiming more is taken for a decompression bomb, a small file that
# would take gigabytes to decode. Checked here, without changing Pillow's global Image.MAX_IMAGE_PIXELS.
MAX_IMAGE_PIXELS = 2**30 // 4 // 3

MODES = ("RGB", "L")
BACKGROUND = 255  # transparent pixels are shown over white, as an image viewer or a web page does


# The file name endings taken for images inside a folder (a file named explicitly is tried whatever its name).
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".ppm", ".pgm", ".pbm",
                    ".pnm")
# Folders that are never searched for images, besides hidden ones: macOS's zip residue, holding only ._* files
# (AppleDouble resource forks, not images).
IGNORED_FOLDERS = frozenset({"__MACOSX"})


def is_ignored_name(name: str) -> bool:
    """A file or folder name never taken as an image or a class: hidden (`.x`, which includes macOS's `._x`
    resource forks and `.ipynb_checkpoints`) or `__MACOSX`."""
    return name.startswith(".") or name in IGNORED_FOLDERS


def image_files(folder: str | os.PathLike[str], extensions: Sequence[str] = IMAGE_EXTENSIONS) -> list[Path]:
    """The image files in `folder` and its sub-folders, as an image-folder dataset takes them: names ending in
    one of `extensions` (any case); hidden files and folders and `__MACOSX` skipped; symbolic links to folders
    followed (a link back to a folder above it is not, so a loop ends); each folder's files in sorted order,
    then its sub-folders in sorted order. A broken symbolic link with an image name is listed (opening it then
    fails with BadImageError)."""
    exts = tuple(e.lower() for e in extensions)
    top = os.fspath(folder)
    # The real paths of each pending folder and of those above it on the way down: a sub-folder that is one of
    # them (a link back up, directly or through other links) is a loop.
    above = {top: frozenset({os.path.realpath(top)})}
    out = []
    for dirpath, dirnames, filenames in os.walk(top, followlinks=True):
        chain = above.pop(dirpath, frozenset())
        keep = []
        for d in sorted(dirnames):
            if is_ignored_name(d):
                continue
            target = os.path.realpath(os.path.join(dirpath, d))
            if target in chain:
                continue
            above[os.path.join(dirpath, d)] = chain | {target}
            keep.append(d)
        dirnames[:] = keep
        out += [Path(dirpath) / f for f in sorted(filenames)
                if not is_ignored_name(f) and f.lower().endswith(exts)]
    return out


# Why an image was refused, for a caller that answers each differently (`vitkit serve`'s HTTP status codes).
REASONS = ("empty", "not-an-image", "too-many-pixels", "corrupt", "link", "other")


class BadImageError(ValueError):
    """A file that cannot be used as an image; the message names it, `reason` (one of REASONS) says why."""

    def __init__(self, message: str, path: str | os.PathLike[str] | None = None, reason: str = "other"):
        super().__init__(message)
        if reason not in REASONS:
            raise ValueError(f"reason={reason!r}: choose from {', '.join(REASONS)}")
        self.path = Path(path) if path is not None else None
        self.reason = reason


def _high_depth_to_8bit(im: Image.Image, sixteen_bit: bool = False) -> Image.Image:
    """16/32-bit integer ('I', 'I;16*') and float ('F') images to 'L', by scaling, not clipping (Pillow's
    convert('L') clips 16-bit values at 255).

    Integer images are taken as 16-bit when their mode or the file (`sixteen_bit`: a 16-bit PGM opens as 'I')
    says so, or a value exceeds 255, and as 8-bit otherwise: a dark 16-bit frame is not brightened 257 times.
    Float images in [0, 1] are scaled by 255, in [0, 255] kept; any other range is stretched from its minimum
    to its maximum.
    """
    a = np.asarray(im).astype(np.float64)
    if im.mode == "F":
        lo, hi = (float(a.min()), float(a.max())) if a.size else (0.0, 0.0)
        if not np.isfinite(a).all():
            a = np.nan_to_num(a, nan=0.0, posinf=hi if np.isfinite(hi) else 0.0, neginf=0.0)
            lo, hi = float(a.min()), float(a.max())
        if lo >= 0.0 and hi <= 1.0:
            a = a * 255.0
        elif lo < 0.0 or hi > 255.0:
            a = (a - lo) * (255.0 / (hi - lo)) if hi > lo else np.zeros_like(a)
    elif im.mode.startswith("I;16") or sixteen_bit or (a.size and a.max() > 255):
        a = np.clip(a, 0, 65535) / 257.0  # 65535 / 257 = 255
    a = np.clip(np.rint(a), 0, 255).astype(np.uint8)
    return Image.fromarray(a, mode="L")


def _lab_to_rgb(im: Image.Image) -> Image.Image:
    from PIL import ImageCms  # LittleCMS; only CIE L*a*b* images need it

    srgb, lab = ImageCms.createProfile("sRGB"), ImageCms.createProfile("LAB")
    transform = ImageCms.buildTransform(lab, srgb, "LAB", "RGB")
    return ImageCms.applyTransform(im, transform)


def _flatten_alpha(im: Image.Image) -> Image.Image:
    """An image with transparency, composited over the background, as 'RGB'."""
    rgba = im.convert("RGBA")
    background = Image.new("RGBA", rgba.size, (BACKGROUND, BACKGROUND, BACKGROUND, 255))
    return Image.alpha_composite(background, rgba).convert("RGB")


def convert_mode(im: Image.Image, mode: str = "RGB", sixteen_bit: bool = False) -> Image.Image:
    """Any Pillow image as 'RGB' or 'L' (grey uses ITU-R 601 luma, Pillow's convert('L')). `sixteen_bit`: the
    file says its integer samples are 16-bit (see _high_depth_to_8bit)."""
    if mode not in MODES:
        raise ValueError(f"mode={mode!r}: choose RGB or L")
    if im.mode == mode:
        return im
    if im.mode in ("I", "F") or im.mode.startswith("I;16"):
        im = _high_depth_to_8bit(im, sixteen_bit)
    elif im.mode == "LAB":
        im = _lab_to_rgb(im)
    elif im.mode in ("La", "RGBa"):  # premultiplied alpha: undo it first
        im = im.convert("LA" if im.mode == "La" else "RGBA")
    if im.mode in ("LA", "PA", "RGBA") or (im.mode == "P" and "transparency" in im.info) or (
        im.mode == "L" and "transparency" in im.info) or (im.mode == "RGB" and "transparency" in im.info):
        im = _flatten_alpha(im)
    return im if im.mode == mode else im.convert(mode)


def open_image(path: str | os.PathLike[str], mode: str = "RGB") -> Image.Image:
    """Open and fully decode an image file, converted to `mode` ('RGB' or 'L').

    Raises BadImageError (a ValueError naming the file) for an empty, corrupt, truncated or non-image file, a
    broken symbolic link (or a loop of them) and an image above MAX_IMAGE_PIXELS (checked from the header,
    before decoding), and FileNotFoundError for a missing one. Multi-frame files (GIF, TIFF) give their first
    frame.
    """
    if mode not in MODES:
        raise ValueError(f"mode={mode!r}: choose RGB or L")
    path = Path(path)
    try:
        size = path.stat().st_size
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise BadImageError(f"{path}: a loop of symbolic links", path, "link") from e
        if isinstance(e, (FileNotFoundError, NotADirectoryError)) and path.is_symlink():
            raise BadImageError(f"{path}: broken symbolic link (to {os.readlink(path)}, which does not "
                                "exist)", path, "link") from e
        raise
    if size == 0:
        raise BadImageError(f"{path}: empty file", path, "empty")
    return _decode(path, str(path), path, mode, MAX_IMAGE_PIXELS)


def decode_image(data: bytes, mode: str = "RGB", max_pixels: int = MAX_IMAGE_PIXELS,
                 name: str = "image") -> Image.Image:
    """`open_image` for an image held in memory (an upload): decoded and converted to `mode`, refused with a
    BadImageError whose message starts with `name` when empty, not an image, corrupt or truncated, or above
    `max_pixels` (checked from the header, before decoding)."""
    if mode not in MODES:
        raise ValueError(f"mode={mode!r}: choose RGB or L")
    if not data:
        raise BadImageError(f"{name}: empty (0 bytes)", reason="empty")
    return _decode(io.BytesIO(data), name, None, mode, max_pixels)


# warnings.catch_warnings swaps the process's filter list and puts it back on exit: two threads inside at once
# can leave one's filter installed for good. Concurrent decodes (a server's, a loader's threads) take turns.
_OPEN_LOCK = threading.Lock()


def _open(source: Path | io.BytesIO) -> Image.Image:
    """Pillow's Image.open (the header only, fast), its decompression-bomb warning raised as an error: Pillow
    warns, and only errors at twice its limit. One thread at a time; the decoding itself runs in parallel."""
    with _OPEN_LOCK, warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        return Image.open(source)


def _decode(source: Path | io.BytesIO, name: str, path: Path | None, mode: str,
            max_pixels: int) -> Image.Image:
    """Decode `source` (a file or bytes), converted to `mode`; every way it can fail as a BadImageError
    starting with `name`."""
    if ImageFile.LOAD_TRUNCATED_IMAGES:
        raise RuntimeError("PIL.ImageFile.LOAD_TRUNCATED_IMAGES is set: truncated files would pass as images")
    try:
        with _open(source) as im:
            width, height = im.size
            if width * height > max_pixels:
                raise BadImageError(
                    f"{name}: {width}x{height} pixels is over the limit of {max_pixels:,} "
                    "(a decompression bomb?); refused", path, "too-many-pixels")
            # Which raw layout the file decodes from, known only before load(): a 16-bit PGM/PPM opens as
            # mode 'I' like any 32-bit image, and only its decoder's 'I;16B' says that 65535 is white.
            sixteen_bit = any("16" in str(getattr(tile, "args", "")) for tile in im.tile)
            im.load()
            return convert_mode(im, mode, sixteen_bit)
    except BadImageError:
        raise
    except (Image.DecompressionBombWarning, Image.DecompressionBombError) as e:
        raise BadImageError(f"{name}: refused as a decompression bomb ({e})", path, "too-many-pixels") from e
    except Image.UnidentifiedImageError as e:
        raise BadImageError(f"{name}: not an image file (Pillow cannot identify it)", path,
                            "not-an-image") from e
    except (OSError, SyntaxError, ValueError, EOFError, IndexError, TypeError, MemoryError) as e:
        # Pillow reports truncated and corrupt data as OSError ("image file is truncated"), and some decoders
        # as SyntaxError, ValueError or struct/index errors.
        if isinstance(e, (FileNotFoundError, PermissionError, IsADirectoryError)):
            raise
        raise BadImageError(f"{name}: corrupt or truncated image ({type(e).__name__}: {e})", path,
                            "corrupt") from e
