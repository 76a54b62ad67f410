"""CIFAR-10 and CIFAR-100 from tiny files in the official binary format, written here."""

from __future__ import annotations

import hashlib
import io
import struct
import tarfile
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

from vitkit.data import DownloadError, cifar, locations, resolve
from vitkit.data.cifar import load_cifar

CIFAR10_NAMES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]


def cifar_records(images: np.ndarray, *label_columns: np.ndarray) -> bytes:
    """Records of the binary version: the label byte(s), then the R, G, B 32x32 planes, row-major."""
    n = images.shape[0]
    rows = [np.asarray(col, np.uint8).reshape(n, 1) for col in label_columns]
    rows.append(images.reshape(n, 3 * 32 * 32))
    return np.concatenate(rows, axis=1).astype(np.uint8).tobytes()


def write_cifar10(folder: Path, per_batch: int = 3, n_test: int = 4, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    written = {}
    for name in [f"data_batch_{i}.bin" for i in range(1, 6)] + ["test_batch.bin"]:
        n = n_test if name == "test_batch.bin" else per_batch
        images = rng.integers(0, 256, (n, 3, 32, 32), dtype=np.uint8)
        labels = rng.integers(0, 10, n, dtype=np.uint8)
        (folder / name).write_bytes(cifar_records(images, labels))
        written[name] = (images, labels)
    # The official batches.meta.txt ends with blank lines.
    (folder / "batches.meta.txt").write_text("\n".join(CIFAR10_NAMES) + "\n\n")
    return written


def write_cifar100(folder: Path, n_train: int = 6, n_test: int = 3, seed: int = 1) -> dict:
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    written = {}
    for name, n in (("train.bin", n_train), ("test.bin", n_test)):
        images = rng.integers(0, 256, (n, 3, 32, 32), dtype=np.uint8)
        coarse = rng.integers(0, 20, n, dtype=np.uint8)
        fine = rng.integers(0, 100, n, dtype=np.uint8)
        (folder / name).write_bytes(cifar_records(images, coarse, fine))
        written[name] = (images, coarse, fine)
    (folder / "fine_label_names.txt").write_text("\n".join(f"fine{i}" for i in range(100)) + "\n")
    (folder / "coarse_label_names.txt").write_text("\n".join(f"coarse{i}" for i in range(20)) + "\n")
    return written


@pytest.fixture
def isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("VITKIT_DATA", raising=False)
    monkeypatch.setattr(locations, "SYSTEM_DATA_DIRS", ())
    return tmp_path


def test_cifar10_binary(isolated):
    written = write_cifar10(isolated / "data" / "cifar-10-batches-bin")
    train = resolve("cifar10", "train", data_dir=isolated / "data")
    test = resolve("cifar-10", "test", data_dir=isolated / "data")
    assert train.classes == CIFAR10_NAMES and train.num_channels == 3
    assert train.images.shape == (15, 3, 32, 32) and test.images.shape == (4, 3, 32, 32)
    expected = np.concatenate([written[f"data_batch_{i}.bin"][0] for i in range(1, 6)])
    assert torch.equal(train.images, torch.from_numpy(expected))
    assert torch.equal(test.targets, torch.from_numpy(written["test_batch.bin"][1].astype(np.int64)))
    # The planes are R, G, B: pixel (row 5, col 7) of image 2's green plane is byte 1 + 1024 + 5*32 + 7.
    raw = (isolated / "data" / "cifar-10-batches-bin" / "test_batch.bin").read_bytes()
    record = raw[2 * 3073: 3 * 3073]
    assert int(test.images[2, 1, 5, 7]) == record[1 + 1024 + 5 * 32 + 7]
    image, label = test[2]
    assert image.shape == (3, 32, 32) and label == record[0]


def test_cifar100_fine_and_coarse(isolated, monkeypatch):
    written = write_cifar100(isolated / "env" / "cifar-100-binary")
    monkeypatch.setenv("VITKIT_DATA", str(isolated / "env"))  # found through $VITKIT_DATA
    fine = resolve("cifar100", "train")
    assert len(fine.classes) == 100 and fine.classes[7] == "fine7"
    assert torch.equal(fine.targets, torch.from_numpy(written["train.bin"][2].astype(np.int64)))
    assert torch.equal(fine.images, torch.from_numpy(written["train.bin"][0]))
    coarse = load_cifar("cifar100", "test", label="coarse")
    assert len(coarse.classes) == 20
    assert torch.equal(coarse.targets, torch.from_numpy(written["test.bin"][1].astype(np.int64)))


def test_cifar_errors_name_the_file(isolated):
    with pytest.raises(FileNotFoundError, match="cifar10 .*data_batch_1.bin"):
        resolve("cifar10", data_dir=isolated / "nothing", download=False)
    folder = isolated / "data"
    write_cifar10(folder)
    with (folder / "data_batch_3.bin").open("ab") as f:
        f.write(b"\x00" * 10)
    with pytest.raises(ValueError, match="data_batch_3.bin.*3073-byte"):
        resolve("cifar10", data_dir=folder)
    write_cifar10(folder)
    (folder / "batches.meta.txt").write_text("a\nb\n")
    with pytest.raises(ValueError, match="batches.meta.txt names 2 classes"):
        resolve("cifar10", data_dir=folder)


def test_cifar_label_names_not_text_name_the_file(isolated):
    folder = isolated / "data"
    write_cifar10(folder)
    (folder / "batches.meta.txt").write_bytes(b"\xff\xfe\x00bad")
    with pytest.raises(ValueError, match=r"batches\.meta\.txt: not a text file"):
        resolve("cifar10", data_dir=folder)


def test_data_dir_lacking_a_file_warns_of_the_fall_back(isolated, monkeypatch, recwarn):
    env = isolated / "env" / "cifar-10-batches-bin"
    write_cifar10(env)
    monkeypatch.setenv("VITKIT_DATA", str(isolated / "env"))
    given = isolated / "given"
    write_cifar10(given / "cifar-10-batches-bin", n_test=2)
    (given / "cifar-10-batches-bin" / "data_batch_4.bin").unlink()
    with pytest.warns(UserWarning) as caught:
        assert len(resolve("cifar10", "train", data_dir=given, download=False)) == 15
    message = str(caught[0].message)
    assert message.startswith("cifar10 (train): ") and message.endswith(f"using {env} instead")
    assert f"{given / 'cifar-10-batches-bin'} lacks data_batch_4.bin;" in message
    recwarn.clear()
    assert len(resolve("cifar10", "test", data_dir=given, download=False)) == 2  # test_batch.bin is there
    assert not [w for w in recwarn if issubclass(w.category, UserWarning)]


# --- download of the official archive, served over real HTTP on loopback ----------------------------------
def make_archive(source: Path, dest: Path) -> str:
    """A .tar.gz of `source` as its top folder, like the official archive; returns its MD5."""
    with tarfile.open(dest, "w:gz") as tar:
        tar.add(source, arcname=source.name)
    return hashlib.md5(dest.read_bytes()).hexdigest()


def test_cifar10_download_unpacks_and_loads(isolated, http_server, monkeypatch):
    served, url = http_server
    written = write_cifar10(isolated / "src" / "cifar-10-batches-bin", per_batch=2, n_test=3)
    md5 = make_archive(isolated / "src" / "cifar-10-batches-bin", served / "cifar-10-binary.tar.gz")
    monkeypatch.setenv("VITKIT_CIFAR_URL", url)
    monkeypatch.setitem(cifar.CIFAR_ARCHIVES, "cifar10",
                        ("cifar-10-binary.tar.gz", md5, "cifar-10-batches-bin"))
    test = resolve("cifar10", "test")  # download=True by default; goes to ~/.cache/vitkit
    assert torch.equal(test.images, torch.from_numpy(written["test_batch.bin"][0]))
    cache = isolated / "home" / ".cache" / "vitkit"
    assert sorted(p.name for p in cache.iterdir()) == ["cifar-10-batches-bin"]  # archive and temp folder gone
    assert len(resolve("cifar10", "train", download=False)) == 10


def test_cifar_download_bad_md5_and_unsafe_archive(isolated, http_server):
    served, url = http_server
    write_cifar100(isolated / "src" / "cifar-100-binary")
    make_archive(isolated / "src" / "cifar-100-binary", served / "cifar-100-binary.tar.gz")
    target = isolated / "target"
    with pytest.raises(DownloadError,
                       match=r"cifar-100-binary\.tar\.gz downloaded from .* has MD5 [0-9a-f]{32}, expected "
                             r"f{32}"):
        load_cifar("cifar100", data_dir=target, download=True, base_url=url, md5="f" * 32)
    assert not any(target.iterdir())
    # An archive with a member that would land outside the target folder is refused.
    evil = served / "evil.tar.gz"
    with tarfile.open(evil, "w:gz") as tar:
        info = tarfile.TarInfo("../escaped.txt")
        info.size = 3
        tar.addfile(info, io.BytesIO(b"bad"))
    (served / "cifar-100-binary.tar.gz").write_bytes(evil.read_bytes())
    md5 = hashlib.md5(evil.read_bytes()).hexdigest()
    with pytest.raises(DownloadError, match="cannot unpack"):
        load_cifar("cifar100", data_dir=target, download=True, base_url=url, md5=md5)
    assert not (isolated / "escaped.txt").exists() and not any(target.iterdir())


def corrupt_deflate_archive(source: Path, dest: Path) -> str:
    """A .tar.gz of `source` whose deflate stream turns invalid halfway (a block of the reserved type 3), with
    a valid gzip header: opening it works, unpacking it fails inside zlib. Returns its MD5."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        tar.add(source, arcname=source.name)
    data = buf.getvalue()
    deflate = zlib.compressobj(6, zlib.DEFLATED, -15)  # raw deflate, as inside gzip
    body = deflate.compress(data[: len(data) // 2]) + deflate.flush(zlib.Z_FULL_FLUSH) + b"\x07"
    dest.write_bytes(b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\xff" + body
                     + struct.pack("<II", zlib.crc32(data), len(data)))
    return hashlib.md5(dest.read_bytes()).hexdigest()


def test_cifar_download_with_a_corrupt_deflate_stream_names_the_archive(isolated, http_server):
    """An archive whose MD5 matches (here: the one given) but whose compressed data is corrupt fails with
    DownloadError naming it, as a broken tar does, not zlib's own error; nothing is left behind."""
    served, url = http_server
    src = isolated / "src" / "cifar-10-batches-bin"
    src.mkdir(parents=True)
    (src / "test_batch.bin").write_bytes(
        np.random.default_rng(0).integers(0, 256, 3073 * 20, np.uint8).tobytes())
    md5 = corrupt_deflate_archive(src, served / "cifar-10-binary.tar.gz")
    with pytest.raises(zlib.error), tarfile.open(served / "cifar-10-binary.tar.gz") as tar:  # the premise
        tar.extractall(isolated / "scratch", filter="data")
    target = isolated / "target"
    with pytest.raises(DownloadError,
                       match=r"cifar-10-binary\.tar\.gz: cannot unpack \(.*invalid block type"):
        load_cifar("cifar10", "test", data_dir=target, download=True, base_url=url, md5=md5)
    assert not any(target.iterdir())
