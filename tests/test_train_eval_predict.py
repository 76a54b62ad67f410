"""Evaluation metrics against a manual computation; eval and predict from the command line."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

import vitkit
from train_helpers import synthetic_dataset, synthetic_images
from vitkit.data.transforms import normalize_batch
from vitkit.train.evaluate import confusion_png, evaluate
from vitkit.train.predict import predict

CFG = vitkit.ViTConfig(image_size=28, patch_size=7, in_chans=1, num_classes=10, dim=32, depth=1, num_heads=2,
                       mlp_dim=64, name="tiny")


def random_model():
    model = vitkit.create_model(CFG)
    torch.nn.init.normal_(model.head.weight, std=0.5)  # the zero-initialised head would predict one class
    return model.eval()


def test_metrics_equal_a_manual_computation():
    data = synthetic_dataset(53, seed=7)  # 53: the last batch is partial
    model = random_model()
    r = evaluate(model, data, batch_size=20)
    with torch.no_grad():
        logits = model(normalize_batch(data.images, CFG))
    y = data.targets
    pred = logits.argmax(1)
    assert r.count == 53
    assert r.top1 == pytest.approx((pred == y).float().mean().item())
    top5 = (logits.topk(5, 1).indices == y[:, None]).any(1).float().mean().item()
    assert r.top5 == pytest.approx(top5)
    assert r.loss == pytest.approx(F.cross_entropy(logits, y).item(), rel=1e-5)
    for c in range(10):
        assert r.confusion[c].sum() == (y == c).sum()
        assert r.confusion[c, c] == ((pred == c) & (y == c)).sum()
        if (y == c).any():
            assert r.per_class[c] == pytest.approx(((pred == c) & (y == c)).sum().item()
                                                   / (y == c).sum().item())
    assert r.to_dict()["per_class"]["Trouser"] == r.per_class[1]


def test_confusion_png(tmp_path):
    r = evaluate(random_model(), synthetic_dataset(30, seed=8))
    path = confusion_png(r, tmp_path / "cm.png")
    with Image.open(path) as im:
        assert im.size[0] > 200 and im.size[1] > 200


def write_pngs(folder, n, seed):
    folder.mkdir(parents=True, exist_ok=True)
    images, _ = synthetic_images(n, seed)
    paths = []
    for i in range(n):
        paths.append(folder / f"img{i}.png")
        Image.fromarray(images[i, 0].numpy()).save(paths[-1])
    return paths


def test_predict_files_and_folders_with_a_bad_file(tmp_path):
    model = random_model()
    good = write_pngs(tmp_path / "imgs", 3, seed=9)
    (tmp_path / "imgs" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not really")
    single = write_pngs(tmp_path / "one", 1, seed=10)[0]
    preds, failures = predict(model, [tmp_path / "imgs", single, tmp_path / "missing.png"], top_k=3,
                              class_names=[f"c{i}" for i in range(10)])
    assert [p.path for p in preds] == [*good, single]
    assert all(len(p.labels) == 3 and p.probs == sorted(p.probs, reverse=True) for p in preds)
    assert {f.path.name for f in failures} == {"broken.png", "missing.png"}
    # The probabilities are the model's softmax.
    with torch.no_grad():
        x = normalize_batch(torch.from_numpy(np.array(Image.open(single)))[None, None], CFG)
        p = model(x).softmax(-1)[0]
    assert preds[-1].probs[0] == pytest.approx(p.max().item(), rel=1e-5)


def test_classify_yields_each_batch_as_it_is_done(tmp_path, monkeypatch):
    """A large folder's first labels come after one batch: with batches of 2, the first two predictions are
    given when only the first two of six files have been opened; a bad file is reported where it is met."""
    import vitkit.train.predict as P

    paths = write_pngs(tmp_path / "imgs", 6, seed=11)
    (tmp_path / "imgs" / "img2b.png").write_bytes(b"")  # sorts after img2.png
    opened = []
    real = P.open_image
    monkeypatch.setattr(P, "open_image", lambda path, mode: (opened.append(path), real(path, mode))[1])
    results = P.classify(random_model(), [tmp_path / "imgs"], batch_size=2)
    first, second = next(results), next(results)
    assert [first.path, second.path] == paths[:2] and len(opened) == 2
    rest = list(results)
    assert ([type(r).__name__ for r in rest]
            == ["Failure", "Prediction", "Prediction", "Prediction", "Prediction"])
    assert rest[0].path.name == "img2b.png" and [r.path for r in rest[1:]] == paths[2:]


def test_predict_refuses_a_model_without_a_classifier_and_names_that_do_not_fit(tmp_path):
    image = write_pngs(tmp_path / "imgs", 1, seed=11)
    headless = vitkit.create_model(CFG.replace(num_classes=0))
    with pytest.raises(ValueError, match=r"no classifier \(num_classes=0\)"):
        predict(headless, image)
    with pytest.raises(ValueError, match="3 class names for a model with 10 classes"):
        predict(random_model(), image, class_names=["a", "b", "c"])


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "vitkit.cli.main", *map(str, args)], capture_output=True,
                          text=True, timeout=180)


def cli_here(capsys, *args) -> tuple[int, str, str]:
    """`vitkit ARGS` in this process (no interpreter to start): its exit status, stdout and stderr."""
    from vitkit.cli.main import main

    capsys.readouterr()
    try:
        main([str(a) for a in args])
        code = 0
    except SystemExit as e:
        code = e.code or 0
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_eval_and_predict(tmp_path, capsys):
    """The installed command end to end (a process of its own, its exit status and its two streams), then the
    options in this process: --no-fast agrees with the fast path, --json and --progress keep stdout clean."""
    model = random_model()
    vitkit.save(model, tmp_path / "ckpt", class_names=[f"class{i}" for i in range(10)])
    # An image folder with 10 class sub-folders (eval takes a dataset name or a folder).
    for c in range(10):
        write_pngs(tmp_path / "data" / f"class{c}", 2, seed=20 + c)
    r = run_cli("eval", tmp_path / "ckpt", "--data", tmp_path / "data", "--out", tmp_path / "ev")
    assert r.returncode == 0, r.stderr
    metrics = json.loads((tmp_path / "ev" / "metrics.json").read_text())
    assert metrics["count"] == 20 and 0 <= metrics["top1"] <= metrics["top5"] <= 1
    assert (tmp_path / "ev" / "confusion.png").is_file() and "top-1" in r.stdout
    # The fast path (vitkit.optimize, the default) and the plain model agree.
    code, _, err = cli_here(capsys, "eval", tmp_path / "ckpt", "--data", tmp_path / "data", "--out",
                            tmp_path / "ev2", "--no-fast")
    assert code == 0, err
    plain_metrics = json.loads((tmp_path / "ev2" / "metrics.json").read_text())
    assert (plain_metrics["top1"], plain_metrics["top5"]) == (metrics["top1"], metrics["top5"])
    assert plain_metrics["confusion"] == metrics["confusion"]

    imgs = write_pngs(tmp_path / "pred", 2, seed=40)
    (tmp_path / "pred" / "zero.png").write_bytes(b"")
    r = run_cli("predict", tmp_path / "ckpt", tmp_path / "pred", "--top-k", "2")
    assert r.returncode == 1
    assert [line.split(":")[0] for line in r.stdout.splitlines()] == [str(p) for p in imgs]
    errors = r.stderr.strip().splitlines()
    assert len(errors) == 1 and errors[0].startswith("error: ") and "zero.png" in errors[0]
    code, out, err = cli_here(capsys, "predict", tmp_path / "ckpt", imgs[0], "--json")
    assert code == 0, err
    assert len(json.loads(out)["labels"]) == 5
    # A bar asked for goes to stderr, and stdout keeps only the results' lines.
    code, out, err = cli_here(capsys, "predict", tmp_path / "ckpt", tmp_path / "pred", "--top-k", "2",
                              "--progress")
    assert code == 1 and out == r.stdout and "predict" in err and "/3 " in err
    assert any(line.startswith("error: ") and "zero.png" in line for line in err.splitlines())


def test_cli_eval_and_predict_options(tmp_path, capsys):
    """--device is parsed (a name torch lacks is one error line), --workers read the folder, the default
    output folder of another split is its own, predict --json reports a bad file as JSON, and a model of 5
    classes or fewer reports no top-5 (every label is among the top 5)."""
    from vitkit.cli.main import main

    def cli(*args) -> int:
        try:
            main([str(a) for a in args])
        except SystemExit as e:
            return e.code or 0
        return 0

    model = vitkit.create_model(CFG.replace(num_classes=3))
    torch.nn.init.normal_(model.head.weight, std=0.5)
    vitkit.save(model, tmp_path / "ckpt", class_names=["a", "b", "c"])
    for split in ("test", "train"):
        for c, name in enumerate("abc"):
            write_pngs(tmp_path / "data" / split / name, 2, seed=60 + c)
    assert cli("eval", tmp_path / "ckpt", "-d", tmp_path / "data", "--device", "tpu9") == 1
    assert "unknown device 'tpu9'" in capsys.readouterr().err
    assert cli("eval", tmp_path / "ckpt", "-d", tmp_path / "data", "--split", "train", "--workers", "2",
               "--no-progress", "--device", "cpu") == 0
    out = capsys.readouterr().out
    # beside the checkpoint folder, never inside it (a run replaces it whole; an upload sends it as it is)
    metrics = json.loads((tmp_path / "eval-ckpt-data-train" / "metrics.json").read_text())
    assert metrics["count"] == 6 and metrics["top5"] is None and "top-5" not in out and "top-1" in out
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["config.json", "model.safetensors"]
    (tmp_path / "bad.png").write_bytes(b"")
    assert cli("predict", tmp_path / "ckpt", tmp_path / "bad.png", "--json", "--no-fast") == 1
    failure = json.loads(capsys.readouterr().err.strip().splitlines()[0])
    assert failure["path"] == str(tmp_path / "bad.png") and "bad.png" in failure["error"]
    assert cli("predict", tmp_path / "ckpt", tmp_path / "bad.png", "--device", "cuda:7") == 1
    assert "no CUDA device" in capsys.readouterr().err or torch.cuda.is_available()


def test_evaluation_scores_each_readable_image_once(tmp_path):
    """With skip_bad_images, 20 readable + 2 bad files are 20 images scored and 2 skipped, not 22 (training
    takes a good file in a bad one's place; evaluation must not count it twice)."""
    from vitkit.data import ImageFolderDataset

    write_pngs(tmp_path / "data" / "class0", 12, seed=50)
    write_pngs(tmp_path / "data" / "class1", 8, seed=51)
    (tmp_path / "data" / "class0" / "bad.png").write_bytes(b"not an image")
    (tmp_path / "data" / "class1" / "empty.png").write_bytes(b"")
    cfg = CFG.replace(num_classes=2)
    model = vitkit.create_model(cfg).eval()
    ds = ImageFolderDataset(tmp_path / "data", mode="L", skip_bad_images=True)
    r = evaluate(model, ds, cfg, batch_size=5)
    assert (r.count, r.skipped) == (20, 2)
    assert r.confusion.sum(dim=1).tolist() == [12, 8]
    assert r.to_dict()["skipped"] == 2
    twice = evaluate(model, ds, cfg, batch_size=5, world=1)  # the bad files are known now: still skipped
    assert (twice.count, twice.skipped) == (20, 2)


def strict_json(text):
    def refuse(constant):
        raise ValueError(f"not JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


def test_cli_eval_skips_bad_images_writes_valid_json_and_matches_classes_by_name(tmp_path, capsys):
    model = vitkit.create_model(CFG.replace(num_classes=3))
    torch.nn.init.normal_(model.head.weight, std=0.5)
    vitkit.save(model, tmp_path / "ckpt", class_names=["a", "b", "c"])
    # The folder lacks class b: its c must still be class 2, and b's accuracy is null (no images), not NaN.
    write_pngs(tmp_path / "data" / "a", 3, seed=60)
    write_pngs(tmp_path / "data" / "c", 3, seed=61)
    (tmp_path / "data" / "c" / "zz.png").write_bytes(b"broken")
    code, _, err = cli_here(capsys, "eval", tmp_path / "ckpt", "--data", tmp_path / "data", "--out",
                            tmp_path / "ev", "--skip-bad-images")
    assert code == 0, err
    metrics = strict_json((tmp_path / "ev" / "metrics.json").read_text())
    assert (metrics["count"], metrics["skipped"]) == (6, 1)
    assert metrics["skipped_images"] == [str(tmp_path / "data" / "c" / "zz.png")]  # named, as in result.json
    assert metrics["per_class"]["b"] is None
    assert [sum(row) for row in metrics["confusion"]] == [3, 0, 3]
    # A class the checkpoint does not know is refused, named, in one line.
    write_pngs(tmp_path / "data" / "d", 1, seed=62)
    code, _, err = cli_here(capsys, "eval", tmp_path / "ckpt", "--data", tmp_path / "data")
    assert code != 0 and "Traceback" not in err
    assert err.startswith(f"error: {tmp_path / 'data'} has classes that {tmp_path / 'ckpt'} "
                                 "lacks: d (")


def test_match_classes_of_eval():
    from vitkit.cli.train import match_classes
    from vitkit.data import TensorImageDataset

    def data(*names):
        return TensorImageDataset(torch.zeros(len(names), 1, 2, 2, dtype=torch.uint8),
                                  torch.arange(len(names)), list(names))

    same, note = match_classes(data("a", "b"), ["a", "b"], 2, "D", "C")
    assert note is None and same.targets.tolist() == [0, 1]
    subset, note = match_classes(data("b"), ["a", "b"], 2, "D", "C")
    assert note is None and subset.targets.tolist() == [1] and subset.classes == ["a", "b"]
    with pytest.raises(ValueError, match="D has classes that C lacks: x"):
        match_classes(data("a", "x"), ["a", "b"], 2, "D", "C")
    # Other names for the same number of classes (WordNet ids for ImageNet names): by position, with a note.
    wnids, note = match_classes(data("n01", "n02"), ["tench", "goldfish"], 2, "D", "C")
    assert wnids.targets.tolist() == [0, 1] and "sorted order" in note
    with pytest.raises(ValueError, match="D has 3 classes but C predicts 2"):
        match_classes(data("n01", "n02", "n03"), ["tench", "goldfish"], 2, "D", "C")
    unnamed, note = match_classes(data("x", "y"), None, 2, "D", "C")
    assert note is None


def test_eval_writes_beside_the_checkpoint_and_here_for_a_hub_name(tmp_path, monkeypatch):
    from vitkit.cli.train import _default_eval_dir

    (tmp_path / "run" / "best").mkdir(parents=True)
    (tmp_path / "vit.safetensors").write_bytes(b"")
    monkeypatch.chdir(tmp_path)
    assert _default_eval_dir(str(tmp_path / "run" / "best"), "fashion-mnist") == \
        tmp_path / "run" / "eval-best-fashion-mnist"
    assert _default_eval_dir(str(tmp_path / "vit.safetensors"), "/data/pets", "val") == \
        tmp_path / "eval-vit-pets-val"
    assert _default_eval_dir("hf-hub:google/vit-base-patch16-224", "cifar10") == \
        Path("eval-vit-base-patch16-224-cifar10")
