"""The data-scaling study (benchmarks/study_data_scaling.py): its tiny twin end to end (cells trained and
recorded, a second run skips them, the report renders tables and a PNG), the balanced subsets it trains on,
the names of its cells and records, its seed, device and time-limit options, and its step in
benchmarks/gpu_check.sh. They run on a small stand-in for Fashion-MNIST that they write themselves
(train_helpers.write_fake_fashion_mnist, found through $VITKIT_DATA before any installed copy), so that they
pass on a machine without the dataset and give the same results on one with it."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from train_helpers import synthetic_images, write_fake_fashion_mnist
from vitkit.data.locations import DATA_ENV
from vitkit.data.subsets import balanced_indices

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import study_data_scaling as study  # noqa: E402
from study_cells import MEAN, STD, Cell, StudyData  # noqa: E402

FAKE_TRAIN, FAKE_TEST = 1000, 300  # enough for the tiny twin's 200-image cells and its 200 test images


@pytest.fixture(scope="module", autouse=True)
def fake_fashion_mnist(tmp_path_factory):
    """Fashion-MNIST's four IDX files with synthetic images, as $VITKIT_DATA for this module's tests and the
    processes they start."""
    folder = tmp_path_factory.mktemp("data") / "fashion-mnist"
    write_fake_fashion_mnist(folder, FAKE_TRAIN, FAKE_TEST)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(DATA_ENV, str(folder.parent))
        yield folder


def test_balanced_indices_hold_every_class_equally_and_nest():
    order = torch.randperm(500, generator=torch.Generator().manual_seed(1))
    labels = torch.arange(10).repeat_interleave(50)[order]
    small, large = balanced_indices(labels, 30, 10), balanced_indices(labels, 100, 10)
    assert small == sorted(small) and len(set(large)) == 100
    assert torch.bincount(labels[torch.tensor(large)], minlength=10).tolist() == [10] * 10
    assert torch.bincount(labels[torch.tensor(small)], minlength=10).tolist() == [3] * 10
    assert set(small) <= set(large)  # one seed: the smaller subset lies inside the larger
    assert balanced_indices(labels, 100, 10, seed=1) != large
    with pytest.raises(ValueError, match="multiple of the 10 classes"):
        balanced_indices(labels, 105, 10)
    with pytest.raises(ValueError, match="class 0 has 50 images"):
        balanced_indices(labels, 600, 10)


def test_cell_keys_name_model_variant_size_seed_and_steps(tmp_path):
    assert Cell("vit", 60000, 1, 400, variant="pos-2d").key == "vit-pos-2d_n60000_s1_t400"
    assert Cell("resnet", 1000, 0, 400).key == "resnet_n1000_s0_t400"
    assert Cell("hybrid", 100, 0, 3, tiny=True).key == "tiny-hybrid_n100_s0_t3"
    assert study.record_file(tmp_path, Cell("vit", 1000, 0, 400)) == tmp_path / "vit_n1000_s0_t400.json"
    with pytest.raises(ValueError, match="ViT only"):
        Cell("resnet", 1000, 0, 400, variant="gap")
    with pytest.raises(ValueError, match="choose from vit, resnet, hybrid"):
        Cell("mlp", 1000, 0, 400)
    keys = [c.key for c in study.study_cells()]
    assert len(keys) == len(set(keys)) == 24  # 5 sizes x 3 models, a second seed up to 10k
    ablation_keys = {c.key for c in study.ablation_cells()}
    assert len(ablation_keys) == 18 and "vit_n60000_s0_t400" in set(keys) & ablation_keys


def test_study_default_records_folder_follows_the_naming():
    out = study.default_out(tiny=False)
    assert out.parent == study.RESULTS and out.name.startswith("study-data-scaling_")


def test_tiny_twin_trains_records_resumes_and_reports(tmp_path):
    out = tmp_path / "records"
    study.main(["--tiny", "--out", str(out), "--cells", "tiny-[vr]*_n100_*"])
    files = sorted(p.name for p in out.glob("*.json"))
    assert files == ["tiny-resnet_n100_s0_t3.json", "tiny-vit_n100_s0_t3.json"]
    record = json.loads((out / files[1]).read_text())
    assert record["key"] == "tiny-vit_n100_s0_t3" and record["cell"]["train_size"] == 100
    assert 0.0 <= record["test_top1"] <= 1.0 and record["test_images"] == study.TINY_TEST
    assert set(record["fewshot"]) == {"5", "10"} and len(record["fewshot"]["10"]["draws"]) == 3
    assert record["macs_per_image"] > 0 and record["machine"]["cpu"]
    assert not list(out.glob(".*.tmp"))  # written atomically

    mtimes = {p: p.stat().st_mtime_ns for p in out.glob("*.json")}
    ran = study.run_cells(study.study_cells(tiny=True)[:1] + study.study_cells(tiny=True)[1:2], out,
                          lambda: pytest.fail("no data should be loaded: every cell is recorded"))
    assert ran == [] and {p: p.stat().st_mtime_ns for p in out.glob("*.json")} == mtimes

    table, figure = tmp_path / "table.md", tmp_path / "fig.png"
    study.main(["--tiny", "--out", str(out), "--report", "--table", str(table), "--figure", str(figure)])
    text = table.read_text()
    assert "| 100 |" in text and "to run" in text  # the hybrid and the n200 cells are missing
    assert "2 of 6 cells recorded; still to run: tiny-hybrid_n100_s0_t3" in text
    assert figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_study_data_normalises_and_limits_the_test_set():
    data = StudyData.load(test_limit=50)
    assert data.test_x.shape == (50, 1, 28, 28) and len(data.train_y) == FAKE_TRAIN
    images, labels = synthetic_images(FAKE_TRAIN, 1)  # what write_fake_fashion_mnist wrote for train
    torch.testing.assert_close(data.train_x, (images.float() / 255 - MEAN) / STD)
    assert torch.equal(data.train_y, labels)


def test_seeds_give_every_size_that_many_seeds_seed_by_seed():
    cells = study.study_cells(seeds=3)
    assert len(cells) == len({c.key for c in cells}) == 3 * len(study.SIZES) * 3
    assert [c.seed for c in cells] == sorted(c.seed for c in cells)  # a cut run keeps whole seeds
    assert {c.seed for c in cells if c.train_size == 60000} == {0, 1, 2}
    assert {c.key for c in study.study_cells()} <= {c.key for c in study.study_cells(seeds=2)}
    ablations = study.ablation_cells(seeds=4)
    assert len(ablations) == 4 * len(study.VARIANTS) and {c.seed for c in ablations} == {0, 1, 2, 3}
    assert len(study.study_cells(tiny=True, seeds=2)) == 2 * len(study.TINY_SIZES) * 3


def test_device_and_seed_options_are_checked(capsys):
    with pytest.raises(SystemExit):
        study.main(["--tiny", "--device", "tpu", "--list"])
    assert "--device 'tpu'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        study.main(["--tiny", "--seeds", "0", "--list"])
    assert "--seeds 0: need at least 1" in capsys.readouterr().err
    assert study.resolve_device("cpu") == torch.device("cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="sees no CUDA GPU"):
            study.resolve_device("cuda")
        assert study.resolve_device("auto") == torch.device("cpu")


def test_time_limit_starts_no_cell_past_it(tmp_path, capsys):
    study.main(["--tiny", "--out", str(tmp_path), "--time-limit", "0"])
    assert "stopping before tiny-vit_n100_s0_t3: past --stop-at or --time-limit" in capsys.readouterr().out
    assert not list(tmp_path.glob("*.json"))


def test_gpu_check_study_step_runs_the_tiny_twin_and_archives_its_records(tmp_path):
    """benchmarks/gpu_check.sh's study steps in their CPU form (QUICK=1, ONLY=study): the tiny twin with two
    seeds, the ablations, the report, and one archive of the records in $OUT."""
    import subprocess
    import tarfile

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PY": sys.executable, "QUICK": "1", "ONLY": "study", "OUT": str(tmp_path / "out"),
           "TMPDIR": str(tmp_path)}
    run = subprocess.run(["bash", str(root / "benchmarks" / "gpu_check.sh")], env=env, capture_output=True,
                         text=True, timeout=360)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "== train_demo" not in run.stdout and "== tests" not in run.stdout  # ONLY=study
    (archive,) = (tmp_path / "out").glob("study-data-scaling-tiny_*.tar.gz")
    with tarfile.open(archive) as tar:
        names = {Path(n).name for n in tar.getnames()}
    assert {"tiny-vit_n100_s1_t3.json", "tiny-hybrid_n200_s0_t3.json", "tiny-vit-gap_n200_s1_t3.json",
            "table.md", "figure.png"} <= names
