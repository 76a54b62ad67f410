"""Which files of a folder are images and which sub-folders are classes: one rule (`image_files`) for
image-folder datasets and `vitkit predict`; class folders that are not classes; which split a folder
served."""

from __future__ import annotations

from pathlib import Path

import pytest
from PIL import Image

import vitkit
from vitkit.data import ImageFolderDataset, resolve
from vitkit.data.images import image_files
from vitkit.train.predict import expand_paths, predict


def png(path: Path, shade: int = 0) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("L", (8, 8), shade).save(path)
    return path


def cluttered(folder: Path, elsewhere: Path) -> list[Path]:
    """A folder of images among things that are not images, as real folders are; returns its images in the
    order they are listed (each folder's files sorted, then its sub-folders sorted)."""
    images = [png(folder / "C.JPG"), png(folder / "b.png")]  # sorted as strings: upper case first
    for name in ("doc.pdf", "figure.eps", "weights.h5", "notes.txt"):  # Pillow registers .pdf, .eps, .h5
        (folder / name).write_bytes(b"not an image\n")
    (folder / "._b.png").write_bytes(b"\x00\x05\x16\x07 AppleDouble")  # macOS resource fork
    png(folder / ".ipynb_checkpoints" / "b-checkpoint.png")
    png(folder / "__MACOSX" / "._b.png")
    images.append(png(folder / "sub" / "d.png"))
    png(elsewhere / "e.png")
    (folder / "zlinked").symlink_to(elsewhere, target_is_directory=True)  # a symlinked sub-folder is followed
    images.append(folder / "zlinked" / "e.png")
    (folder / "sub" / "up").symlink_to(folder, target_is_directory=True)  # a loop: not followed
    return images


def test_image_files_rules(tmp_path):
    images = cluttered(tmp_path / "imgs", tmp_path / "elsewhere")
    assert image_files(tmp_path / "imgs") == images
    assert [p.name for p in images] == ["C.JPG", "b.png", "d.png", "e.png"]
    assert image_files(tmp_path / "imgs", extensions=[".pdf"]) == [tmp_path / "imgs" / "doc.pdf"]


def test_predict_finds_the_images_a_dataset_finds(tmp_path):
    """`vitkit predict folder/` lists what ImageFolderDataset lists for a class folder: no .pdf/.eps/.h5
    errors, no hidden files or folders, symlinked sub-folders followed."""
    images = cluttered(tmp_path / "data" / "cls", tmp_path / "elsewhere")
    files, failures = expand_paths([tmp_path / "data" / "cls"])
    assert files == images and failures == []
    assert [p for p, _ in ImageFolderDataset(tmp_path / "data").samples] == images
    # A file named on the command line is tried whatever its name; a broken link is handed on to say so.
    (tmp_path / "broken.png").symlink_to(tmp_path / "nowhere.png")
    files, failures = expand_paths([tmp_path / "data" / "cls" / "doc.pdf", tmp_path / "broken.png",
                                    tmp_path / "missing.png"])
    assert files == [tmp_path / "data" / "cls" / "doc.pdf", tmp_path / "broken.png"]
    assert [f.path.name for f in failures] == ["missing.png"]


def test_predict_on_a_cluttered_folder_reports_no_errors(tmp_path):
    cfg = vitkit.ViTConfig(image_size=8, patch_size=4, in_chans=1, num_classes=3, dim=16, depth=1,
                           num_heads=2, mlp_dim=32, name="tiny")
    model = vitkit.create_model(cfg).eval()
    images = cluttered(tmp_path / "imgs", tmp_path / "elsewhere")
    predictions, failures = predict(model, [tmp_path / "imgs"], top_k=2)
    assert failures == [] and [p.path for p in predictions] == images
    predictions, failures = predict(model, [tmp_path / "imgs" / "doc.pdf"], top_k=2)
    assert predictions == [] and "doc.pdf" in failures[0].message


def test_macosx_and_hidden_folders_are_not_classes(tmp_path):
    png(tmp_path / "cat" / "a.png")
    png(tmp_path / "dog" / "b.png")
    png(tmp_path / "__MACOSX" / "cat" / "._a.png")
    png(tmp_path / ".cache" / "x.png")
    ds = ImageFolderDataset(tmp_path)
    assert ds.classes == ["cat", "dog"] and len(ds) == 2


def test_a_class_folder_without_images_is_refused_naming_it(tmp_path):
    png(tmp_path / "cat" / "a.png")
    (tmp_path / "empty_cls").mkdir()
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "README.txt").write_text("not an image")
    png(tmp_path / "hidden_only" / ".x.png")
    with pytest.raises(ValueError,
                       match=r"no image files .* in class folders empty_cls/, hidden_only/, notes/"):
        ImageFolderDataset(tmp_path)
    with pytest.raises(ValueError, match=r"in class folders empty_cls/"):
        resolve(tmp_path, "test")
    for name in ("empty_cls", "notes", "hidden_only"):
        for f in (tmp_path / name).iterdir():
            f.unlink()
        (tmp_path / name).rmdir()
    (tmp_path / "dog").mkdir()
    with pytest.raises(ValueError, match=r"in class folder dog/;"):
        ImageFolderDataset(tmp_path)


def test_split_of_root_tells_a_folder_without_split_folders(tmp_path):
    """Without train/, test/, val/ sub-folders a folder serves every split from its root: the test split is
    then the training images, which `split_of_root` (or comparing the roots) tells."""
    plain = tmp_path / "plain"
    png(plain / "cat" / "a.png")
    png(plain / "dog" / "b.png")
    train, test = resolve(plain, "train"), resolve(plain, "test")
    assert (train.split, test.split) == ("train", "test")
    assert train.split_of_root and test.split_of_root
    assert train.root.resolve() == test.root.resolve() and len(test) == 2  # served as before
    split = tmp_path / "split"
    for name in ("train", "test"):
        png(split / name / "cat" / "a.png")
    train, test = resolve(split, "train"), resolve(split, "test")
    assert not train.split_of_root and not test.split_of_root
    assert train.root.resolve() != test.root.resolve()
    direct = ImageFolderDataset(plain)
    assert direct.split is None and not direct.split_of_root
