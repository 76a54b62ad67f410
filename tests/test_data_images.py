"""Opening images safely (every Pillow mode, bad files, decompression bombs) and image-folder datasets with
and without skipping bad files."""

from __future__ import annotations

import io
import struct
import zlib
from pathlib import Path

import numpy as np
import PIL
import pytest
import torch
from PIL import Image

from vitkit.data import BadImageError, ImageFolderDataset, TransformedDataset, resolve
from vitkit.data.images import MAX_IMAGE_PIXELS, convert_mode, open_image

ALL_MODES = ["1", "L", "LA", "La", "P", "PA", "RGB", "RGBA", "RGBa", "RGBX", "CMYK", "YCbCr", "LAB", "HSV",
             "I", "I;16", "I;16B", "I;16L", "F"]


def noise_image(size=(24, 20), seed=0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8), "RGB")


def png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


# --- modes ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ALL_MODES)
def test_every_pillow_mode_converts(mode):
    im = Image.new(mode, (5, 3))
    for target in ("RGB", "L"):
        out = convert_mode(im, target)
        assert out.mode == target and out.size == (5, 3)


@pytest.mark.parametrize(("mode", "fmt"), [("1", "PNG"), ("L", "PNG"), ("LA", "PNG"), ("P", "PNG"),
                                           ("RGBA", "PNG"), ("CMYK", "JPEG"), ("CMYK", "TIFF"),
                                           ("I;16", "PNG"),
                                           ("I", "TIFF"), ("F", "TIFF"), ("YCbCr", "TIFF"), ("RGB", "WEBP"),
                                           ("L", "GIF"), ("RGB", "BMP")])
def test_saved_files_of_each_mode_open(tmp_path, mode, fmt):
    path = tmp_path / f"img.{fmt.lower()}"
    noise_image().convert(mode).save(path, fmt)
    try:
        with Image.open(path) as im:
            im.load()
    except OSError as e:  # seen with a YCbCr TIFF on another machine's Pillow: nothing open_image could fix
        pytest.skip(f"this Pillow {PIL.__version__} cannot read back its own {mode} {fmt} file ({e})")
    assert open_image(path).mode == "RGB" and open_image(path).size == (24, 20)
    assert open_image(path, mode="L").mode == "L"


def test_16_bit_is_scaled_not_clipped(tmp_path):
    values = np.array([[0, 257 * 100, 65535]], dtype=np.uint16)
    path = tmp_path / "deep.png"
    Image.fromarray(values).save(path)  # a 16-bit grey PNG
    assert np.asarray(open_image(path, "L")).tolist() == [[0, 100, 255]]
    floats = Image.fromarray(np.array([[0.0, 0.5, 1.0]], dtype=np.float32), "F")
    assert np.asarray(convert_mode(floats, "L")).tolist() == [[0, 128, 255]]


def test_transparency_goes_over_white_and_palette_colours_kept(tmp_path):
    rgba = Image.new("RGBA", (2, 1))
    rgba.putpixel((0, 0), (10, 20, 30, 255))
    rgba.putpixel((1, 0), (10, 20, 30, 0))
    path = tmp_path / "alpha.png"
    rgba.save(path)
    assert np.asarray(open_image(path)).tolist() == [[[10, 20, 30], [255, 255, 255]]]
    pal = Image.new("P", (1, 1))
    pal.putpalette([0, 0, 0, 200, 100, 50] + [0] * 762)
    pal.putpixel((0, 0), 1)
    pal.save(tmp_path / "pal.png")
    assert open_image(tmp_path / "pal.png").getpixel((0, 0)) == (200, 100, 50)
    assert (open_image(tmp_path / "pal.png", "L").getpixel((0, 0))
            == round(0.299 * 200 + 0.587 * 100 + 0.114 * 50))


# --- bad files --------------------------------------------------------------------------------------------
def make_bad_files(folder: Path) -> dict[str, Path]:
    """One file for each way an image file can be bad."""
    folder.mkdir(parents=True, exist_ok=True)
    good_png = folder / "_good.png"
    noise_image((64, 64)).save(good_png)
    good_jpg = folder / "_good.jpg"
    noise_image((64, 64)).save(good_jpg, quality=95)
    png, jpg = good_png.read_bytes(), good_jpg.read_bytes()
    good_png.unlink()
    good_jpg.unlink()
    bad = {
        "empty": folder / "empty.png",
        "random bytes": folder / "random.png",
        "truncated png": folder / "truncated.png",
        "truncated jpeg": folder / "truncated.jpg",
        "corrupt png data": folder / "corrupt.png",
        "text named .jpg": folder / "notes.jpg",
    }
    bad["empty"].write_bytes(b"")
    bad["random bytes"].write_bytes(np.random.default_rng(0).integers(0, 256, 3000, dtype=np.uint8).tobytes())
    bad["truncated png"].write_bytes(png[: len(png) // 2])
    bad["truncated jpeg"].write_bytes(jpg[: len(jpg) // 2])
    middle = len(png) // 2
    bad["corrupt png data"].write_bytes(png[:middle] + bytes(b ^ 0xFF for b in png[middle:middle + 64])
                                        + png[middle + 64:])
    bad["text named .jpg"].write_text("these are my notes, not a picture\n" * 20)
    return bad


def test_bad_files_raise_bad_image_error_naming_the_file(tmp_path):
    for kind, path in make_bad_files(tmp_path).items():
        with pytest.raises(BadImageError, match=path.name) as info:
            open_image(path)
        assert isinstance(info.value, ValueError), kind
        assert info.value.path == path, kind
    with pytest.raises(FileNotFoundError):
        open_image(tmp_path / "missing.png")


def test_broken_symbolic_link_is_a_bad_image_naming_it(tmp_path):
    link = tmp_path / "broken.png"
    link.symlink_to(tmp_path / "no-such-target.png")
    with pytest.raises(BadImageError,
                       match=r"broken\.png: broken symbolic link \(to .*no-such-target\.png") as info:
        open_image(link)
    assert info.value.path == link
    loop = tmp_path / "loop.png"
    loop.symlink_to(loop)
    with pytest.raises(BadImageError, match=r"loop\.png: a loop of symbolic links"):
        open_image(loop)


def test_decompression_bombs_are_refused(tmp_path):
    # A PNG whose header claims 30000 x 30000 pixels (900 Mpx) around a few bytes of data.
    header = b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", struct.pack(">IIBBBBB", 30000, 30000, 8, 0, 0, 0, 0))
    bomb = tmp_path / "bomb.png"
    bomb.write_bytes(header + png_chunk(b"IDAT", zlib.compress(b"\x00" * 30001)) + png_chunk(b"IEND", b""))
    with pytest.raises(BadImageError, match=r"bomb\.png: .*refused"):
        open_image(bomb)
    # A real, valid 1-bit PNG just over the limit: 60 kB on disk, 96 Mpx decoded.
    real = tmp_path / "real-bomb.png"
    Image.new("1", (12000, 8000)).save(real)
    assert MAX_IMAGE_PIXELS < 12000 * 8000 and real.stat().st_size < 200_000
    with pytest.raises(BadImageError, match="real-bomb.png"):
        open_image(real)
    assert Image.MAX_IMAGE_PIXELS == 2**30 // 4 // 3  # Pillow's global limit is left as it was


def test_concurrent_decodes_leave_the_warning_filters_as_they_were(monkeypatch):
    """warnings.catch_warnings saves the filter list on entry and puts it back on exit: threads inside it at
    once (a slow header, here a slowed Image.open) would put back one another's "error" filter for good. The
    decoders take turns there, and every thread still refuses a bomb."""
    import threading
    import time
    import warnings

    from vitkit.data.images import decode_image

    real_open = Image.open

    def slow_open(*args, **kwargs):
        time.sleep(0.01)
        return real_open(*args, **kwargs)

    monkeypatch.setattr(Image, "open", slow_open)
    header = b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", struct.pack(">IIBBBBB", 30000, 30000, 8, 0, 0, 0, 0))
    bomb = header + png_chunk(b"IDAT", zlib.compress(b"\x00" * 30001)) + png_chunk(b"IEND", b"")
    small = io.BytesIO()
    noise_image().save(small, format="PNG")
    before = list(warnings.filters)
    refused = []

    def work():
        for _ in range(5):
            decode_image(small.getvalue())
            try:
                decode_image(bomb, name="bomb")
            except BadImageError:
                refused.append(True)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert warnings.filters == before and len(refused) == 20


# --- image folders ----------------------------------------------------------------------------------------
def make_folder(root: Path, bad: bool = False) -> Path:
    (root / "cat").mkdir(parents=True)
    (root / "dog").mkdir()
    (root / ".hidden").mkdir()
    for i in range(3):
        noise_image(seed=i).save(root / "cat" / f"c{i}.png")
        noise_image(seed=10 + i).convert("L").save(root / "dog" / f"d{i}.jpg")
    noise_image().convert("RGBA").save(root / "dog" / "d3.png")
    (root / "dog" / "README.txt").write_text("not an image, and not named like one: ignored")
    noise_image().save(root / ".hidden" / "x.png")
    if bad:
        for path in make_bad_files(root / "cat").values():
            path.rename(root / "cat" / ("b_" + path.name))
    return root


def test_image_folder(tmp_path):
    ds = ImageFolderDataset(make_folder(tmp_path / "pets"))
    assert ds.classes == ["cat", "dog"] and len(ds) == 7 and ds.num_channels == 3
    assert ds.targets.tolist() == [0, 0, 0, 1, 1, 1, 1]
    image, label = ds[4]
    assert isinstance(image, Image.Image) and image.mode == "RGB" and label == 1
    grey = ImageFolderDataset(tmp_path / "pets", mode="L")
    assert grey[0][0].mode == "L" and grey.num_channels == 1


def test_image_folder_bad_file_stops_with_its_name(tmp_path):
    ds = ImageFolderDataset(make_folder(tmp_path / "pets", bad=True))
    assert len(ds) == 13
    names = [p.name for p, _ in ds.samples]
    with pytest.raises(BadImageError, match="b_corrupt.png"):
        ds[names.index("b_corrupt.png")]
    with pytest.raises(BadImageError, match="b_notes.jpg"):
        ds[names.index("b_notes.jpg")]
    with pytest.raises(BadImageError, match="b_corrupt.png"):  # the first bad file in order
        ds.check_all(progress=False)


def test_image_folder_skips_and_counts_bad_files(tmp_path):
    ds = ImageFolderDataset(make_folder(tmp_path / "pets", bad=True), skip_bad_images=True)
    bad_names = {p.name for p, _ in ds.samples if p.name.startswith("b_")}
    assert len(bad_names) == 6
    items = [ds[i] for i in range(len(ds))]
    assert all(isinstance(im, Image.Image) for im, _ in items)
    assert ds.num_skipped == 6 and {p.name for p in ds.skipped} == bad_names
    # A bad file's place is taken by the next good one: the cat folder sorts b_* before c*.
    names = [p.name for p, _ in ds.samples]
    assert np.array_equal(np.asarray(items[names.index("b_empty.png")][0]),
                          np.asarray(ds[names.index("c0.png")][0]))
    assert ds.num_skipped == 6  # found once, counted once


def test_skips_found_in_dataloader_workers_are_counted(tmp_path):
    ds = ImageFolderDataset(make_folder(tmp_path / "pets", bad=True), skip_bad_images=True)
    loader = torch.utils.data.DataLoader(
        TransformedDataset(ds, lambda im: torch.from_numpy(np.asarray(im.resize((8, 8))).copy())),
        batch_size=4, num_workers=2)
    labels = torch.cat([y for _, y in loader])
    assert len(labels) == 13
    assert ds.num_skipped == 6  # recorded in the workers, seen here


def test_broken_symbolic_link_in_a_class_folder_is_skipped_or_named(tmp_path):
    """A dangling link (`cat/broken.png -> nowhere`) is an unreadable file like a corrupt one: skipped and
    recorded with skip_bad_images (by read, by indexing, by check_all and in a DataLoader), named without."""
    root = make_folder(tmp_path / "pets")
    link = root / "cat" / "broken.png"
    link.symlink_to(tmp_path / "nowhere.png")
    skipping = ImageFolderDataset(root, skip_bad_images=True)
    names = [p.name for p, _ in skipping.samples]
    assert "broken.png" in names and len(skipping) == 8
    assert skipping.read(names.index("broken.png")) is None and skipping.skipped == [link]
    assert isinstance(skipping[names.index("broken.png")][0], Image.Image)  # the next good file in its place
    assert ImageFolderDataset(root, skip_bad_images=True).check_all(progress=False) == [link]
    strict = ImageFolderDataset(root)
    with pytest.raises(BadImageError, match="broken.png: broken symbolic link"):
        strict[names.index("broken.png")]
    with pytest.raises(BadImageError, match="broken.png"):
        strict.check_all(progress=False)


def test_file_gone_since_listing_is_skipped_or_named(tmp_path):
    root = make_folder(tmp_path / "pets")
    skipping, strict = ImageFolderDataset(root, skip_bad_images=True), ImageFolderDataset(root)
    (root / "cat" / "c1.png").unlink()
    assert skipping.read(1) is None and [p.name for p in skipping.skipped] == ["c1.png"]
    with pytest.raises(FileNotFoundError, match="c1.png"):
        strict.read(1)


def test_check_all_up_front(tmp_path):
    ds = ImageFolderDataset(make_folder(tmp_path / "pets", bad=True), skip_bad_images=True)
    assert len(ds.check_all(progress=False)) == 6 and ds.num_skipped == 6


def test_resolve_folder_and_its_splits(tmp_path):
    make_folder(tmp_path / "plain")
    assert resolve(tmp_path / "plain").classes == ["cat", "dog"]
    make_folder(tmp_path / "split" / "train")
    (tmp_path / "split" / "val" / "cat").mkdir(parents=True)
    noise_image().save(tmp_path / "split" / "val" / "cat" / "v.png")
    assert len(resolve(str(tmp_path / "split"), "train")) == 7
    val = resolve(tmp_path / "split", "val")
    assert len(val) == 1 and val.classes == ["cat"]
    with pytest.raises(FileNotFoundError, match="split folders train, val but no 'test'"):
        resolve(tmp_path / "split", "test")
    with pytest.raises(FileNotFoundError, match="not a folder, and not a dataset name"):
        resolve(tmp_path / "nowhere")
    empty = tmp_path / "empty" / "cat"
    empty.mkdir(parents=True)
    with pytest.raises(ValueError, match="no image files"):
        resolve(tmp_path / "empty")
    skipping = resolve(make_folder(tmp_path / "bad", bad=True), skip_bad_images=True)
    assert skipping.skip_bad_images


def test_read_gives_each_item_itself_or_none(tmp_path):
    """Training takes the next good file for a bad one; `read` (evaluation's way) never substitutes."""
    from vitkit.data.views import read_item

    ds = ImageFolderDataset(make_folder(tmp_path / "pets", bad=True), skip_bad_images=True)
    names = [p.name for p, _ in ds.samples]
    assert ds.read(names.index("b_empty.png")) is None and ds.num_skipped == 1
    assert read_item(torch.utils.data.Subset(ds, [names.index("b_notes.jpg")]), 0) is None
    image, label = read_item(torch.utils.data.Subset(ds, [names.index("d0.jpg")]), 0)
    assert isinstance(image, Image.Image) and label == 1
    readable = [ds.read(i) for i in range(len(ds))]
    assert sum(item is None for item in readable) == 6 and ds.num_skipped == 6
    strict = ImageFolderDataset(tmp_path / "pets")
    with pytest.raises(BadImageError, match="b_corrupt.png"):
        strict.read(names.index("b_corrupt.png"))


def test_with_classes_matches_labels_by_name(tmp_path):
    """A val folder lacking one of the training classes keeps each class's index; an unknown class is
    refused."""
    from vitkit.data import TensorImageDataset
    from vitkit.data.views import LabelMapped, with_classes

    for name in ("a", "c"):
        (tmp_path / "val" / name).mkdir(parents=True)
        noise_image().save(tmp_path / "val" / name / "x.png")
    val = ImageFolderDataset(tmp_path / "val")
    assert val.targets.tolist() == [0, 1]
    mapped = with_classes(val, ["a", "b", "c"])
    assert mapped.classes == ["a", "b", "c"] and mapped.targets.tolist() == [0, 2] and mapped[1][1] == 2
    assert val.targets.tolist() == [0, 1]  # the original is left as it was
    assert with_classes(val, ["a", "c"]) is val
    with pytest.raises(ValueError, match=r"the val split has classes that the training split lacks: c \("):
        with_classes(val, ["a", "b"], "the val split", "the training split")
    memory = TensorImageDataset(torch.zeros(3, 1, 2, 2, dtype=torch.uint8), torch.tensor([0, 1, 1]),
                                ["a", "c"])
    assert with_classes(memory, ["c", "b", "a"]).targets.tolist() == [2, 0, 0]
    other = torch.utils.data.Subset(memory, [0, 1])
    other.classes = ["a", "c"]
    wrapped = with_classes(other, ["a", "b", "c"])
    assert isinstance(wrapped, LabelMapped) and [wrapped[i][1] for i in range(2)] == [0, 2]


def test_split_name_is_the_split_read():
    from vitkit.data.datasets import split_name

    assert split_name("fashion-mnist", "val") == "test" and split_name("cifar10", "test") == "test"
    assert split_name("/no/such/folder", "val") == "val"


@pytest.mark.parametrize("value", [200, 40_000])
def test_a_16_bit_pgm_is_16_bit_however_dark(tmp_path, value):
    """Pillow opens a 16-bit PGM as mode 'I', as a 32-bit image: its decoder's layout says it is 16-bit, so a
    frame of value 200 is 200 / 257 (as the same array saved as a 16-bit PNG), not 200 of 255."""
    import numpy as np
    from PIL import Image

    a = np.full((4, 4), value, np.uint16)
    (tmp_path / "x.pgm").write_bytes(b"P5\n4 4\n65535\n" + a.astype(">u2").tobytes())
    Image.fromarray(a).save(tmp_path / "x.png")
    pgm, png = open_image(tmp_path / "x.pgm", "L"), open_image(tmp_path / "x.png", "L")
    assert (np.array_equal(np.asarray(pgm), np.asarray(png))
            and int(np.asarray(pgm)[0, 0]) == round(value / 257))
    eight = tmp_path / "y.pgm"
    eight.write_bytes(b"P5\n4 4\n255\n" + bytes([200] * 16))
    assert int(np.asarray(open_image(eight, "L"))[0, 0]) == 200
