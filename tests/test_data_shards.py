"""Tar shards (`vitkit shard`, `shards:PATTERN`) and Hugging Face dataset folders (`hf:FOLDER`): written and
read back image for image, counted with or without their index, and refused with what to do."""

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from train_helpers import synthetic_dataset
from vitkit.data import resolve
from vitkit.data.shard_writer import parse_size, shard_pattern, write_shards
from vitkit.data.shards import ShardSet, decode_sample, open_shards, read_shard


def image_folder(root: Path, per_class: int = 6) -> Path:
    """Three classes of small colour images, JPEG and PNG mixed."""
    rng = np.random.default_rng(0)
    for c in ("cat", "dog", "emu"):
        (root / c).mkdir(parents=True)
        for i in range(per_class):
            pixels = rng.integers(0, 255, (12 + i, 16, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(root / c / f"{c}{i}.{'jpg' if i % 2 else 'png'}")
    return root


def every_sample(shards: ShardSet) -> dict[str, dict]:
    """All samples of all shards, by key."""
    out = {}
    for path, count in zip(shards.paths, shards.counts, strict=True):
        out.update({s["__key__"]: s for s in read_shard(path, range(count)).values()})
    return out


def test_a_folder_round_trips_byte_for_byte(tmp_path):
    folder = resolve(image_folder(tmp_path / "src"))
    index = write_shards(folder, tmp_path / "out", parse_size("2KB"), progress=False)
    assert len(index["shards"]) > 2 and index["total"] == len(folder) == 18
    shards = open_shards(shard_pattern(index, tmp_path / "out"))
    assert len(shards) == 18 and list(shards.classes) == ["cat", "dog", "emu"]
    samples = every_sample(shards)
    assert len(samples) == 18
    for i, (path, label) in enumerate(folder.samples):
        sample = samples[f"{i:09d}"]
        ext = "jpg" if path.suffix == ".jpg" else "png"
        assert sample[ext] == path.read_bytes() and int(sample["cls"]) == label
    # each shard holds several classes: the samples were shuffled before writing
    first = read_shard(shards.paths[0], range(shards.counts[0]))
    assert len({int(s["cls"]) for s in first.values()}) > 1


def test_in_memory_images_are_written_losslessly(tmp_path):
    data = synthetic_dataset(40, seed=3)
    index = write_shards(data, tmp_path / "out", parse_size("10KB"), progress=False)
    assert index["num_channels"] == 1
    shards = open_shards(shard_pattern(index, tmp_path / "out"))
    for key, sample in every_sample(shards).items():
        image, label = decode_sample(sample, "L")
        i = int(key)
        assert label == int(data.targets[i])
        assert torch.equal(torch.from_numpy(np.array(image))[None], data.images[i])


def test_shards_without_an_index_are_counted_from_their_tars(tmp_path, capsys):
    folder = resolve(image_folder(tmp_path / "src"))
    index = write_shards(folder, tmp_path / "out", parse_size("2KB"), progress=False)
    (tmp_path / "out" / "index.json").unlink()
    shards = open_shards(str(tmp_path / "out" / "train-{000000..000001}.tar"))  # a subset of the shards
    assert list(shards.counts) == [s["count"] for s in index["shards"][:2]]
    assert "counted their samples by reading the tar headers" in capsys.readouterr().err
    labels = {int(s["cls"]) for s in every_sample(shards).values()}
    assert list(shards.classes) == [str(i) for i in range(max(labels) + 1)]


@pytest.mark.parametrize(("text", "size"), [("500MB", 500 * 10**6), ("1GB", 10**9), ("1.5kb", 1500),
                                            ("256MiB", 256 * 2**20), ("4096", 4096)])
def test_shard_sizes(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "MB", "5XB", "-1MB", "0", "1 2MB"])
def test_bad_shard_sizes_are_refused(text):
    with pytest.raises(ValueError, match="is not a size"):
        parse_size(text)


def test_vitkit_shard_writes_and_refuses_with_what_to_do(tmp_path, capsys):
    from vitkit.cli.main import main

    src = image_folder(tmp_path / "src")
    with pytest.raises(SystemExit) as exit_info:
        main(["shard", str(src), str(tmp_path / "out"), "--shard-size", "3KB", "--no-progress"])
    assert exit_info.value.code == 0
    said = capsys.readouterr().out
    assert "18 images" in said and "data.name=shards:" in said
    pattern = said.split("data.name=shards:")[1].strip()
    assert len(open_shards(pattern)) == 18
    for args, message in (([str(src), str(tmp_path / "out")], "folder is not empty"),
                          ([str(tmp_path / "nope"), str(tmp_path / "o2")], "not a folder"),
                          ([str(src), str(tmp_path / "o3"), "--shard-size", "1XB"], "is not a size"),
                          ([str(src), str(tmp_path / "o4"), "--prefix", "a.b"], "letters, digits")):
        with pytest.raises(SystemExit) as exit_info:
            main(["shard", *args, "--no-progress"])
        err = capsys.readouterr().err
        assert exit_info.value.code == 1 and message in err and "hint:" in err
    with pytest.raises(FileNotFoundError, match="not found"):
        open_shards(str(tmp_path / "out" / "train-{000000..000099}.tar"))
    with pytest.raises(ValueError, match="training only"):
        resolve(f"shards:{pattern}", "test")


def test_a_hugging_face_dataset_folder(tmp_path):
    from datasets import ClassLabel, Dataset, DatasetDict, Features
    from datasets import Image as ImageFeature

    images = [Image.fromarray(np.full((8, 10, 3), 20 * i, np.uint8)) for i in range(6)]
    features = Features({"img": ImageFeature(), "label": ClassLabel(names=["ant", "bee"])})
    one = Dataset.from_dict({"img": images, "label": [i % 2 for i in range(6)]}, features=features)
    one.save_to_disk(str(tmp_path / "one"))
    DatasetDict({"train": one, "validation": one.select([0, 1])}).save_to_disk(str(tmp_path / "dict"))

    data = resolve(tmp_path / "one")  # recognised by its files
    assert len(data) == 6 and data.classes == ["ant", "bee"] and data.split_of_root
    image, label = data[3]
    assert label == 1 and image.size == (10, 8) and np.asarray(image)[0, 0, 0] == 60
    val = resolve(f"hf:{tmp_path / 'dict'}", "val")
    assert len(val) == 2 and not val.split_of_root
    with pytest.raises(FileNotFoundError, match="no 'test' one"):
        resolve(f"hf:{tmp_path / 'dict'}", "test")
    # it trains through a DataLoader with workers, images decoded there
    from torch.utils.data import DataLoader

    from vitkit.data import TransformedDataset

    loader = DataLoader(TransformedDataset(data, lambda im: torch.from_numpy(np.asarray(im).copy())),
                        batch_size=3, num_workers=2)
    assert [y.tolist() for _, y in loader] == [[0, 1, 0], [1, 0, 1]]
    # a run trains on it; and it shards, pixel for pixel
    from vitkit.train import get_recipe, train

    overrides = ["device=cpu", "threads=1", f"data.name=hf:{tmp_path / 'one'}", "data.val_split=",
                 "data.limit=0", "data.workers=1", "batch_size=2", "steps=2", "model.in_chans=3"]
    assert train(get_recipe("demo-tiny", overrides), tmp_path / "run", progress=False).steps == 2
    index = write_shards(data, tmp_path / "shards", parse_size("1MB"), progress=False)
    assert index["classes"] == ["ant", "bee"] and index["num_channels"] == 3
    for key, sample in every_sample(open_shards(shard_pattern(index, tmp_path / "shards"))).items():
        image, label = decode_sample(sample)
        assert label == int(key) % 2 and np.array_equal(np.asarray(image), np.asarray(data[int(key)][0]))
