"""`vitkit analyze ...`, `vitkit fewshot` and `vitkit probe` end to end on a tiny checkpoint and image
folder."""

import json

import numpy as np
import pytest
import torch
from PIL import Image

import vitkit
from vitkit.analysis.distance import mean_attention_distance
from vitkit.analysis.features import compute_features
from vitkit.analysis.fewshot import fewshot_eval
from vitkit.cli.main import main
from vitkit.data import resolve
from vitkit.data.transforms import build_eval_transform

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("analysis")
    torch.manual_seed(0)
    model = vitkit.create_model("ViT-Ti/16", image_size=32, patch_size=8, dim=32, depth=2, num_heads=2,
                                mlp_dim=64, num_classes=2)
    vitkit.save(model, root / "ckpt", class_names=["plain", "striped"])
    rng = np.random.default_rng(0)
    for split in ("train", "test"):
        for c, name in enumerate(("plain", "striped")):
            folder = root / "data" / split / name
            folder.mkdir(parents=True)
            for i in range(4):
                arr = (rng.random((32, 32, 3)) * 80).astype(np.uint8)
                if c:
                    arr[:, ::4] = 255
                Image.fromarray(arr).save(folder / f"{i}.png")
    return root


def run(*args):
    try:
        main([str(a) for a in args])
    except SystemExit as e:
        return e.code
    return 0


def _is_small_png(path):
    data = path.read_bytes()
    return data[:8] == PNG_MAGIC and len(data) < 300_000


def test_attention_filters_posemb_write_figures(setup, tmp_path):
    ckpt, img = setup / "ckpt", setup / "data" / "test" / "striped" / "0.png"
    assert run("analyze", "attention", ckpt, img, setup / "data" / "test" / "plain" / "1.png",
               "--out", tmp_path / "a.png") == 0
    assert run("analyze", "attention", ckpt, img, "--layer", "-1", "--head", "1", "--out",
               tmp_path / "b.png") == 0
    assert run("analyze", "attention", ckpt, "-d", setup / "data", "--indices", "0,5", "--out",
               tmp_path / "c.png") == 0
    assert run("analyze", "filters", ckpt, "--out", tmp_path / "f.png") == 0
    assert run("analyze", "posemb", ckpt, "--out", tmp_path / "p.png") == 0
    for name in ("a", "b", "c", "f", "p"):
        assert _is_small_png(tmp_path / f"{name}.png"), name


def test_filters_refuse_a_hybrid_whose_projection_maps_resnet_channels(tmp_path, capsys):
    cfg = vitkit.get_config("R26+ViT-S/32", image_size=64, dim=32, depth=1, num_heads=2, mlp_dim=64,
                            num_classes=2, hybrid_width=32)
    vitkit.save(vitkit.create_model(cfg), tmp_path / "hybrid")
    assert run("analyze", "filters", tmp_path / "hybrid", "--out", tmp_path / "f.png") == 1
    assert "a hybrid model has no patch filters" in capsys.readouterr().err
    assert not (tmp_path / "f.png").exists()


def test_a_figure_path_without_a_suffix_is_written_and_reported_as_png(setup, tmp_path, capsys):
    assert run("analyze", "posemb", setup / "ckpt", "--out", tmp_path / "noext") == 0
    assert f"wrote {tmp_path / 'noext.png'}" in capsys.readouterr().out
    assert _is_small_png(tmp_path / "noext.png")
    (tmp_path / "figs").mkdir()  # an existing folder: the figure goes inside it, under the command's own name
    assert run("analyze", "posemb", setup / "ckpt", "-o", tmp_path / "figs") == 0
    assert f"wrote {tmp_path / 'figs' / 'posemb.png'}" in capsys.readouterr().out
    assert _is_small_png(tmp_path / "figs" / "posemb.png") and not (tmp_path / "figs.png").exists()


def test_errors_are_one_line_with_a_hint(setup, tmp_path, capsys):
    ckpt = setup / "ckpt"
    assert run("analyze", "attention", ckpt, tmp_path / "missing.png", "--out", tmp_path / "x.png") == 1
    assert "missing.png" in capsys.readouterr().err
    assert run("analyze", "attention", ckpt, setup / "data" / "test" / "plain" / "0.png", "--head", "0") == 1
    err = capsys.readouterr().err
    assert "--head needs --layer" in err and "hint:" in err and "Traceback" not in err
    assert run("analyze", "attention", ckpt, setup / "data" / "test" / "plain" / "0.png", "--layer", "5") == 1
    assert "out of range" in capsys.readouterr().err
    assert run("analyze", "attention", ckpt, "--data", setup / "data", "--indices", "99") == 1
    assert "out of range" in capsys.readouterr().err
    assert run("analyze", "attention", ckpt, "--data", setup / "data", "--indices", "a,b") == 1
    assert "hint: e.g. --indices 0,1,6,8" in capsys.readouterr().err
    assert run("analyze", "attention", ckpt, "--data", setup / "data", "--discard", "1.5") == 1
    assert "error: --discard 1.5 must be at least 0 and below 1" in capsys.readouterr().err
    assert run("analyze", "attention", ckpt) == 1
    assert "image files or --data" in capsys.readouterr().err
    assert run("fewshot", ckpt, "--data", setup / "data", "--shots", "1,x") == 1
    assert "comma-separated" in capsys.readouterr().err
    nopos = vitkit.create_model("ViT-Ti/16", image_size=16, patch_size=8, dim=32, depth=1, num_heads=2,
                                mlp_dim=64, pos_embed="none")
    vitkit.save(nopos, tmp_path / "nopos")
    assert run("analyze", "posemb", tmp_path / "nopos") == 1
    assert "no position embedding" in capsys.readouterr().err


def test_distance_numbers_equal_the_function_on_the_same_images(setup, tmp_path):
    out = tmp_path / "d.json"
    assert run("analyze", "distance", setup / "ckpt", "-d", setup / "data", "--split", "test", "-n", "6",
               "-b", "4", "--out", tmp_path / "d.png", "--json", out, "--device", "cpu") == 0
    assert _is_small_png(tmp_path / "d.png")
    got = torch.tensor(json.loads(out.read_text())["distance_px"], dtype=torch.float64)
    model = vitkit.load(setup / "ckpt")
    data = resolve(str(setup / "data"), "test")
    tf = build_eval_transform(model.cfg)
    # 6 of the 8 test images, spread over the class-sorted folder: both classes, not the first 6
    picked = [0, 1, 2, 4, 5, 6]
    assert {data[i][1] for i in picked} == {0, 1}
    x = torch.stack([tf(data[i][0]) for i in picked])
    with torch.no_grad():
        _, attns = model.forward_features(x, return_attention=True)
    expected = mean_attention_distance(attns, model.cfg.grid_size, 8, 1)
    torch.testing.assert_close(got, expected)


def test_fewshot_and_probe(setup, tmp_path):
    out = tmp_path / "fs.json"
    assert run("fewshot", setup / "ckpt", "-d", setup / "data", "--shots", "1,3", "--seeds", "2",
               "--cache-dir", tmp_path / "cache", "--json", out, "--plot", tmp_path / "fs.png") == 0
    assert _is_small_png(tmp_path / "fs.png")
    assert len(list((tmp_path / "cache").glob("*.safetensors"))) == 2
    got = json.loads(out.read_text())
    model = vitkit.load(setup / "ckpt")
    tf = build_eval_transform(model.cfg)
    tr = compute_features(model, resolve(str(setup / "data"), "train"), transform=tf, progress=False)
    te = compute_features(model, resolve(str(setup / "data"), "test"), transform=tf, progress=False)
    expected = fewshot_eval(tr.features, tr.labels, te.features, te.labels, (1, 3), 2, seeds=2)
    assert [r["shots"] for r in got["results"]] == [1, 3]
    for r, e in zip(got["results"], expected, strict=True):
        assert r["per_seed"] == pytest.approx(list(e.accuracies))
    pout = tmp_path / "probe.json"
    assert run("probe", setup / "ckpt", "--data", setup / "data", "--C", "1.0", "--json", pout) == 0
    probe = json.loads(pout.read_text())
    assert probe["C"] == 1.0 and 0.0 <= probe["accuracy"] <= 1.0 and probe["test_images"] == 8


def _colour_folder(root, splits):
    """Folders of 16x16 images, one flat colour per class: {split: [class names]}."""
    colours = {"a": (250, 10, 10), "b": (10, 250, 10), "c": (10, 10, 250)}
    for split, names in splits.items():
        for name in names:
            (root / split / name).mkdir(parents=True)
            for i in range(3):
                Image.new("RGB", (16, 16), tuple(v + 2 * i for v in colours[name])).save(
                    root / split / name / f"{i}.png")
    return root


@pytest.fixture(scope="module")
def colour_ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("colours")
    torch.manual_seed(0)
    model = vitkit.create_model("ViT-Ti/16", image_size=16, patch_size=8, dim=32, depth=1, num_heads=2,
                                mlp_dim=64, num_classes=3)
    vitkit.save(model, root / "ckpt", class_names=["a", "b", "c"])
    return root / "ckpt"


def test_fewshot_and_probe_number_the_test_classes_as_the_training_ones(colour_ckpt, tmp_path):
    """test/ lacks class b: its folder numbers c as 1, the training folder as 2. Matched by name, the colour
    classes are told apart perfectly; by position every c would count as wrong (50 %)."""
    data = _colour_folder(tmp_path / "d", {"train": ["a", "b", "c"], "test": ["a", "c"]})
    assert run("probe", colour_ckpt, "-d", data, "--C", "10", "--json", tmp_path / "p.json") == 0
    assert json.loads((tmp_path / "p.json").read_text())["accuracy"] == 1.0
    assert run("fewshot", colour_ckpt, "-d", data, "--shots", "2", "--seeds", "1", "--json",
               tmp_path / "f.json") == 0
    assert json.loads((tmp_path / "f.json").read_text())["results"][0]["accuracy"] == 1.0


def test_fewshot_and_probe_refuse_what_would_mislead(colour_ckpt, tmp_path, capsys):
    plain = _colour_folder(tmp_path / "plain", {"": ["a", "b"]})  # no train/ or test/: the same images twice
    for command in ("probe", "fewshot"):
        assert run(command, colour_ckpt, "-d", plain, "--shots" if command == "fewshot" else "--C",
                   "1" if command == "fewshot" else "1.0") == 1
        assert "would be the train images themselves" in capsys.readouterr().err
    extra = _colour_folder(tmp_path / "extra", {"train": ["a", "b"], "test": ["a", "c"]})
    assert run("probe", colour_ckpt, "-d", extra) == 1
    assert "has classes that its train split lacks: c" in capsys.readouterr().err
    both = _colour_folder(tmp_path / "both", {"train": ["a", "b", "c"], "test": ["a", "b", "c"]})
    assert run("fewshot", colour_ckpt, "-d", both, "--shots", "5") == 1
    err = capsys.readouterr().err
    assert "3 of the 3 classes" in err and "fewer than 5 images" in err and "a (3)" in err


def test_max_train_spreads_over_every_class(colour_ckpt, tmp_path):
    """6 of a class-sorted folder's 9 training images: two of each class, not the first two classes' six."""
    from vitkit.data.subsets import spread_indices, spread_subset

    assert spread_indices(9, 6) == [0, 1, 3, 4, 6, 7] and spread_indices(5, 5) == [0, 1, 2, 3, 4]
    data = _colour_folder(tmp_path / "d", {"train": ["a", "b", "c"], "test": ["a", "b", "c"]})
    subset = spread_subset(resolve(str(data), "train"), 6)
    assert sorted(subset.targets.tolist()) == [0, 0, 1, 1, 2, 2] and subset.classes == ["a", "b", "c"]
    assert run("fewshot", colour_ckpt, "-d", data, "--shots", "2", "--seeds", "1", "--max-train", "6",
               "--json", tmp_path / "f.json") == 0
    assert json.loads((tmp_path / "f.json").read_text())["train_pool"] == 6


def test_named_datasets_are_looked_for_in_data_dir(tmp_path, capsys):
    """--data-dir, as on eval: a named dataset from that folder (a 128-image stand-in here, not the machine's
    60,000-image Fashion-MNIST)."""
    from train_helpers import write_fake_fashion_mnist

    data = write_fake_fashion_mnist(tmp_path / "fmnist", n_train=128, n_test=32)
    model = vitkit.create_model("ViT-Ti/16", image_size=28, patch_size=7, in_chans=1, dim=32, depth=1,
                                num_heads=2, mlp_dim=64, num_classes=10)
    vitkit.save(model, tmp_path / "ckpt")
    assert run("fewshot", tmp_path / "ckpt", "-d", "fashion-mnist", "--data-dir", data, "--shots", "1",
               "--seeds", "1", "--json", tmp_path / "f.json") == 0
    assert json.loads((tmp_path / "f.json").read_text())["train_pool"] == 128
    assert run("analyze", "distance", tmp_path / "ckpt", "-d", "fashion-mnist", "--data-dir", data, "-n", "4",
               "-o", tmp_path / "d.png") == 0
    assert run("probe", tmp_path / "ckpt", "-d", "fashion-mnist", "--data-dir", data, "--json",
               tmp_path / "p.json") == 0
    assert json.loads((tmp_path / "p.json").read_text())["train_images"] == 128
