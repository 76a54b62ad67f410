"""Fashion-MNIST: the IDX reader, where the files are looked for, and the download, served for real over HTTP
on loopback by a local server (not mocked)."""

from __future__ import annotations

import gzip
import hashlib
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

from vitkit.data import DownloadError, fashion_mnist, locations, resolve
from vitkit.data.fashion_mnist import FASHION_MNIST_CLASSES, find_fashion_mnist, load_fashion_mnist, read_idx

DEBIAN = Path("/usr/share/datasets/fashion-mnist")


def idx_bytes(array: np.ndarray) -> bytes:
    """An IDX file of unsigned bytes: magic 0x00 0x00 0x08 ndim, big-endian int32 dims, the data."""
    header = bytes([0, 0, 0x08, array.ndim]) + b"".join(int(d).to_bytes(4, "big") for d in array.shape)
    return header + np.ascontiguousarray(array, dtype=np.uint8).tobytes()


def write_fashion_mnist(folder: Path, n_train: int = 12, n_test: int = 5, gz: bool = True,
                        seed: int = 0) -> dict:
    """Tiny Fashion-MNIST-format files; returns the arrays written and each file's MD5."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    arrays = {}
    md5s = {}
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        images = rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
        labels = rng.integers(0, 10, size=(n,), dtype=np.uint8)
        arrays[prefix] = (images, labels)
        for kind, arr in (("images-idx3-ubyte", images), ("labels-idx1-ubyte", labels)):
            data = idx_bytes(arr)
            name = f"{prefix}-{kind}"
            if gz:
                data, name = gzip.compress(data), name + ".gz"
            (folder / name).write_bytes(data)
            md5s[name] = hashlib.md5(data).hexdigest()
    return {"arrays": arrays, "md5": md5s}


@pytest.fixture
def isolated(tmp_path, monkeypatch):
    """No real data anywhere: HOME in tmp, no $VITKIT_DATA, no system dataset folder, no URL override."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("VITKIT_DATA", raising=False)
    monkeypatch.delenv("VITKIT_FASHION_MNIST_URL", raising=False)
    monkeypatch.setattr(locations, "SYSTEM_DATA_DIRS", (tmp_path / "system",))
    return tmp_path


# --- the IDX reader ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("gz", [True, False])
def test_load_from_idx_files_gz_and_raw(isolated, gz):
    folder = isolated / "data"
    written = write_fashion_mnist(folder, gz=gz)
    for split, prefix in (("train", "train"), ("test", "t10k")):
        ds = load_fashion_mnist(split, data_dir=folder, download=False)
        images, labels = written["arrays"][prefix]
        assert ds.images.dtype == torch.uint8 and ds.images.shape == (len(labels), 1, 28, 28)
        assert ds.targets.dtype == torch.int64
        assert torch.equal(ds.images[:, 0], torch.from_numpy(images))
        assert torch.equal(ds.targets, torch.from_numpy(labels.astype(np.int64)))
        assert ds.classes == FASHION_MNIST_CLASSES and ds.num_channels == 1
        image, label = ds[3]
        assert torch.equal(image, ds.images[3]) and label == int(labels[3])


def test_read_idx_errors_name_the_file(tmp_path):
    bad_magic = tmp_path / "bad-magic"
    bad_magic.write_bytes(b"\x01\x02\x08\x01" + (3).to_bytes(4, "big") + b"abc")
    with pytest.raises(ValueError, match="bad-magic.*magic"):
        read_idx(bad_magic)
    short = tmp_path / "short"
    short.write_bytes(idx_bytes(np.zeros((4, 2, 2), np.uint8))[:-3])
    with pytest.raises(ValueError, match="short.*header says shape"):
        read_idx(short)
    wrong_type = tmp_path / "float-type"
    wrong_type.write_bytes(b"\x00\x00\x0d\x01" + (1).to_bytes(4, "big") + b"\x00" * 4)
    with pytest.raises(ValueError, match="float-type.*0x0d"):
        read_idx(wrong_type)
    bad_gz = tmp_path / "bad.gz"
    bad_gz.write_bytes(gzip.compress(idx_bytes(np.zeros((4,), np.uint8)))[:-6])
    with pytest.raises(ValueError, match="bad.gz"):
        read_idx(bad_gz)


def test_corrupt_deflate_stream_names_the_file(isolated):
    """A flipped byte inside the compressed data (not the header or the CRC) makes zlib itself fail; that is
    reported like a truncated file, naming it, from read_idx and from resolve."""
    data = gzip.compress(idx_bytes((np.arange(3000) % 7).astype(np.uint8)))
    for pos in range(10, len(data) - 8):  # 10: past gzip's header, into the deflate stream
        corrupt = bytearray(data)
        corrupt[pos] ^= 0xFF
        try:
            gzip.decompress(bytes(corrupt))
        except zlib.error:
            break
        except (OSError, EOFError):
            continue
    else:
        pytest.fail("no flipped byte made zlib fail")
    folder = isolated / "data"
    write_fashion_mnist(folder)
    (folder / "t10k-labels-idx1-ubyte.gz").write_bytes(bytes(corrupt))
    with pytest.raises(ValueError, match=r"t10k-labels-idx1-ubyte\.gz: corrupt gzip data"):
        read_idx(folder / "t10k-labels-idx1-ubyte.gz")
    with pytest.raises(ValueError, match=r"t10k-labels-idx1-ubyte\.gz: corrupt gzip data"):
        resolve("fashion-mnist", "test", data_dir=folder, download=False)


@pytest.mark.skipif(not DEBIAN.is_dir(), reason="dataset-fashion-mnist is not installed")
def test_corrupt_real_file_names_the_file(tmp_path):
    """The audit's case: byte 20 of a copy of the real test labels flipped."""
    data = bytearray((DEBIAN / "t10k-labels-idx1-ubyte.gz").read_bytes())
    data[20] ^= 0xFF
    (tmp_path / "t10k-labels-idx1-ubyte.gz").write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"t10k-labels-idx1-ubyte\.gz: corrupt gzip data"):
        read_idx(tmp_path / "t10k-labels-idx1-ubyte.gz")


def test_label_count_mismatch_names_the_file(isolated):
    folder = isolated / "data"
    write_fashion_mnist(folder, gz=False)
    (folder / "train-labels-idx1-ubyte").write_bytes(idx_bytes(np.zeros((3,), np.uint8)))
    with pytest.raises(ValueError, match="train-labels-idx1-ubyte"):
        load_fashion_mnist("train", data_dir=folder, download=False)


# --- where the files are looked for -----------------------------------------------------------------------
def test_lookup_order(isolated, monkeypatch):
    """data_dir, then $VITKIT_DATA, then ~/.cache/vitkit, then the system folder; each may hold the files
    directly or in a fashion-mnist/ sub-folder. Each place gets a different number of images to tell them
    apart."""
    system = isolated / "system" / "fashion-mnist"  # Debian's layout: /usr/share/datasets/fashion-mnist
    cache = isolated / "home" / ".cache" / "vitkit" / "fashion-mnist"
    env = isolated / "env"
    given = isolated / "given"
    for n, folder in ((1, system), (2, cache), (3, env), (4, given)):
        write_fashion_mnist(folder, n_train=n)

    assert len(resolve("fashion-mnist")) == 2  # no env, no data_dir: the cache beats the system folder
    monkeypatch.setenv("VITKIT_DATA", str(env))
    assert len(resolve("fashion-mnist")) == 3
    assert len(resolve("fashion-mnist", data_dir=given)) == 4
    assert find_fashion_mnist("train", given)[0] == given / "train-images-idx3-ubyte.gz"
    # A data_dir without the files falls through to the next place, and says so.
    with pytest.warns(UserWarning, match=r"data_dir .*empty does not exist; using .*env instead"):
        assert len(resolve("fashion-mnist", data_dir=isolated / "empty", download=False)) == 3
    monkeypatch.delenv("VITKIT_DATA")
    for f in cache.iterdir():
        f.unlink()
    assert len(resolve("fashion-mnist", download=False)) == 1


def test_data_dir_lacking_a_file_warns_of_the_fall_back(isolated, recwarn):
    """A data_dir that lacks one of the split's files is passed over for the next place that has them all, as
    before, but with a warning naming the missing file and the folder used instead."""
    system = isolated / "system" / "fashion-mnist"
    write_fashion_mnist(system, n_train=3)
    given = isolated / "given"
    write_fashion_mnist(given / "fashion-mnist", n_train=5)
    (given / "fashion-mnist" / "train-labels-idx1-ubyte.gz").unlink()
    with pytest.warns(UserWarning) as caught:
        assert len(resolve("fashion-mnist", "train", data_dir=given, download=False)) == 3
    message = str(caught[0].message)
    assert ("Fashion-MNIST (train)" in message
            and f"{given / 'fashion-mnist'} lacks train-labels-idx1-ubyte" in message)
    assert "train-images" not in message and message.endswith(f"using {system} instead")
    # A data_dir that exists but holds none of the files: said too.
    (given / "fashion-mnist" / "train-images-idx3-ubyte.gz").unlink()
    with pytest.warns(UserWarning,
                      match=r"given \(nor its fashion-mnist.* sub-folders\) has none of its files"):
        resolve("fashion-mnist", "train", data_dir=given, download=False)
    # No warning where the data_dir has them all, or no data_dir is given.
    recwarn.clear()
    assert len(resolve("fashion-mnist", "test", data_dir=given, download=False)) == 5
    assert len(resolve("fashion-mnist", "train", download=False)) == 3
    assert not [w for w in recwarn if issubclass(w.category, UserWarning)]


def test_missing_without_download_lists_the_places(isolated):
    with pytest.raises(FileNotFoundError, match=r"Fashion-MNIST \(train\) not found in .*home"):
        resolve("fashion-mnist", download=False)
    with pytest.raises(ValueError, match="no split 'dev'"):
        resolve("fashion-mnist", split="dev")


# --- the download, over real HTTP on loopback -------------------------------------------------------------
def test_download_over_http_checks_md5_and_loads(isolated, http_server):
    served, url = http_server
    written = write_fashion_mnist(served, n_train=7, n_test=3)
    target = isolated / "downloads"
    ds = load_fashion_mnist("train", data_dir=target, download=True, base_url=url, md5s=written["md5"])
    assert len(ds) == 7
    assert torch.equal(ds.images[:, 0], torch.from_numpy(written["arrays"]["train"][0]))
    got = sorted(p.name for p in (target / "fashion-mnist").iterdir())
    # only the split asked, no temp files
    assert got == ["train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"]
    for name in got:
        assert (target / "fashion-mnist" / name).read_bytes() == (served / name).read_bytes()
    # Found on disk the second time: with the server's files gone, it still loads.
    for f in served.iterdir():
        f.unlink()
    assert len(load_fashion_mnist("train", data_dir=target, download=False)) == 7


def test_download_via_resolve_env_url_into_cache(isolated, http_server, monkeypatch):
    served, url = http_server
    written = write_fashion_mnist(served, n_train=6, n_test=4)
    monkeypatch.setenv("VITKIT_FASHION_MNIST_URL", url)
    for name, md5 in written["md5"].items():
        monkeypatch.setitem(fashion_mnist.FASHION_MNIST_MD5, name, md5)
    ds = resolve("fashion-mnist", split="test")
    assert len(ds) == 4
    assert (isolated / "home" / ".cache" / "vitkit" / "fashion-mnist" / "t10k-images-idx3-ubyte.gz").is_file()


def test_download_with_wrong_md5_fails_and_leaves_nothing(isolated, http_server):
    served, url = http_server
    written = write_fashion_mnist(served)
    md5s = dict(written["md5"])
    md5s["train-images-idx3-ubyte.gz"] = "0" * 32
    target = isolated / "downloads"
    with pytest.raises(DownloadError,
                       match=r"train-images-idx3-ubyte\.gz .*has MD5 [0-9a-f]{32}, expected 0{32}"):
        load_fashion_mnist("train", data_dir=target, download=True, base_url=url, md5s=md5s)
    assert list((target / "fashion-mnist").iterdir()) == []  # neither the bad file nor a temporary one


def test_download_missing_file_names_the_url(isolated, http_server):
    served, url = http_server
    with pytest.raises(DownloadError, match=r"127\.0\.0\.1.*train-images-idx3-ubyte\.gz failed"):
        load_fashion_mnist("train", data_dir=isolated / "d", download=True, base_url=url,
                           md5s=fashion_mnist.FASHION_MNIST_MD5)


def test_published_md5s_are_the_readme_ones():
    # From the "Get the Data" table of github.com/zalandoresearch/fashion-mnist's README.
    assert fashion_mnist.FASHION_MNIST_MD5["train-images-idx3-ubyte.gz"] == "8d4fb7e6c68d591d4c3dfef9ec88bf0d"
    assert fashion_mnist.FASHION_MNIST_MD5["t10k-labels-idx1-ubyte.gz"] == "bb300cfdad3c16e7a12a480ee83cd310"
    assert fashion_mnist.FASHION_MNIST_URL == "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/"


# --- the real files, where Debian's dataset-fashion-mnist is installed -----------------------------------
@pytest.mark.skipif(not DEBIAN.is_dir(), reason="dataset-fashion-mnist is not installed")
def test_real_fashion_mnist(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))  # no cached copy: the Debian files themselves
    monkeypatch.delenv("VITKIT_DATA", raising=False)
    assert find_fashion_mnist("train")[0].parent == DEBIAN
    train, test = (resolve("fashion-mnist", "train", download=False),
                   resolve("fashion-mnist", "test", download=False))
    assert train.images.shape == (60000, 1, 28, 28) and test.images.shape == (10000, 1, 28, 28)
    assert train.classes[:2] == ["T-shirt/top", "Trouser"] and train.classes[-1] == "Ankle boot"
    # The dataset is balanced: 6,000 training and 1,000 test images per class.
    assert torch.equal(train.targets.bincount(), torch.full((10,), 6000))
    assert torch.equal(test.targets.bincount(), torch.full((10,), 1000))
    assert train.images.dtype == torch.uint8 and int(train.images.max()) == 255
