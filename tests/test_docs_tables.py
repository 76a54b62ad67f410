"""The tables of README.md and docs/*.md are what benchmarks/render_tables.py renders from
benchmarks/results/; the renderer itself is checked on small records under tests/fixtures/records."""

import importlib.util
import json
import shlex
import shutil
import sys
from pathlib import Path

import pytest

from vitkit.train import RECIPES, get_recipe
from vitkit.train.settings import TrainConfig

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "records"


def load_script(name: str):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


records = load_script("records")
render = load_script("render_tables")


def test_the_docs_tables_equal_what_the_records_render(capsys):
    assert render.main(["--check"]) == 0, capsys.readouterr().out


def test_every_record_has_a_record_name():
    names = [p.name for p in (ROOT / "benchmarks" / "results").glob("*.json")]
    assert names and all(records.NAME.match(n.removesuffix(".json")) for n in names)


ZEN3_4 = ("AuthenticAMD", 25)
slug_of = records.machine_slug


def test_names_and_slugs():
    assert records.slug("AMD EPYC") == "amd-epyc"
    assert records.slug("Intel(R) Xeon(R) Processor") == "intel-xeon"
    assert records.slug("AMD EPYC 9454 48-Core Processor") == "amd-epyc-9454"
    assert records.slug("Intel(R) Xeon(R) Platinum 8480+ CPU @ 2.00GHz") == "intel-xeon-platinum-8480"
    assert records.slug("NVIDIA H200") == "nvidia-h200"
    # the same model name with and without AVX-512 (AMD family 25: Zen 3 and Zen 4)
    assert slug_of("AMD EPYC", {"avx", "avx2", "fma"}, family=ZEN3_4) == "amd-epyc-avx2"
    assert slug_of("AMD EPYC", {"avx2", "avx512f", "avx512_vnni"}, hold="", family=ZEN3_4) == "amd-epyc"
    # an AVX-512 CPU held to AVX2 (VITKIT_CPU_ISA=avx2): a proxy, not the CPU's own records
    assert slug_of("AMD EPYC", {"avx2", "avx512f"}, hold="avx2", family=ZEN3_4) == "amd-epyc-avx2-proxy"
    assert slug_of("AMD EPYC", {"avx", "avx2", "fma"}, hold="avx2", family=ZEN3_4) == "amd-epyc-avx2"
    assert slug_of("Neoverse-V2", {"sve", "asimd"}, family=("", None)) == "neoverse-v2"
    # a Zen 5 (AMD family 26) is told from the Zen 4 (family 25) of the same name
    zen4, zen5 = ZEN3_4, ("AuthenticAMD", 26)
    assert slug_of("AMD EPYC", {"avx2", "avx512f"}, hold="", family=zen4) == "amd-epyc"
    assert slug_of("AMD EPYC", {"avx2", "avx512f"}, hold="", family=zen5) == "amd-epyc-zen5"
    assert slug_of("AMD EPYC", {"avx2", "avx512f"}, hold="avx2", family=zen5) == "amd-epyc-zen5-avx2-proxy"
    assert slug_of("Intel Xeon", {"avx512f"}, hold="", family=("GenuineIntel", 26)) == "intel-xeon"
    path = records.record_path("infer-b1", "amd-epyc", "2026-12-02", "run1", folder=Path("x"))
    assert path == Path("x/infer-b1_amd-epyc_2026-12-02_run1.json")
    rec = records.Record.parse(path)
    assert (rec.what, rec.where, rec.date, rec.tag) == ("infer-b1", "amd-epyc", "2026-12-02", "run1")
    with pytest.raises(ValueError):
        records.record_path("Infer B1", "amd-epyc", "2026-12-02")
    with pytest.raises(ValueError):
        records.Record.parse(Path("s26_run1_b1.json"))


def test_a_zen5_is_named_in_the_runs_line():
    """lscpu calls a Zen 4 and a Zen 5 "AMD EPYC" alike; a table's caption tells them apart by WHERE."""
    m = {"cpu": "AMD EPYC", "cpu_capability": "AVX512", "vnni": True, "native_bf16": True, "threads": 2,
         "torch": "2.14.1+cpu"}
    zen5 = render.runs_line(m, 3, "vitkit bench --runtimes", "2026-12-07", "amd-epyc-zen5")
    assert zen5.startswith("AMD EPYC Zen 5 (AVX512, VNNI, native bf16), 2 threads, torch 2.14.1; 3 runs")
    zen4 = render.runs_line(m, 3, "vitkit bench --runtimes", "2026-12-06", "amd-epyc")
    assert zen4.startswith("AMD EPYC (")


def test_speed_table_is_the_range_over_the_runs():
    recs = records.records(FIXTURES)
    table = render.speed(recs, "amd-epyc", "2026-12-02")
    rows = {}
    for run in (3, 4):
        for what in ("infer-b1", "infer-b16"):
            data = json.loads((FIXTURES / f"{what}_amd-epyc_2026-12-02_run{run}.json").read_text())
            for r in data["rows"]:
                rows.setdefault((r["model"], r["batch"], r["contender"]), []).append(r["vs_best_anchor"])
    low, high = min(rows[("ViT-S/16", 1, "vitkit-fp32-opt")]), max(rows[("ViT-S/16", 1, "vitkit-fp32-opt")])
    line = next(x for x in table.splitlines() if x.startswith("| ViT-S/16 inference, batch 1 |"))
    assert line.split("|")[3].strip() == f"{low:.2f}-{high:.2f}x"
    assert "AMD EPYC" in table and "2 runs" in table and "2026-12-02" in table
    assert all(len(line) <= 110 for line in table.splitlines() if not line.startswith("|"))


def test_recipes_table_reads_both_kinds_of_record():
    table = render.recipes(records.records(FIXTURES))
    assert (
        "| `demo` | `vitkit train demo --out runs/demo` | 87.68 % | test | 1.0 min | one NVIDIA H200 | "
        "2026-11-30 |" in table
    )
    assert (
        "| `fashion-mnist` | `vitkit train fashion-mnist --out runs/fmnist --nproc 2` | 93.29 % | test | "
        "26.2 min |" in table
    )
    # a run that chose on its held-out part says so
    assert ("| `fashion-mnist` | `vitkit train fashion-mnist --out runs/fmnist --nproc 2 --set seed=1` | "
            "93.20 % | holdout |") in table


def test_recipe_seeds_table_gives_mean_and_spread_over_the_seeds():
    """Three seeds of one command (tests/fixtures/records/recipe-fashion-mnist_*_2026-12-05_seed*.json): one
    row, their mean test top-1 and sample standard deviation; the records that chose on the test set are not
    in it."""
    table = render.recipe_seeds(records.records(FIXTURES))
    rows = [line for line in table.splitlines()[2:]]
    assert rows == ["| `fashion-mnist` | `vitkit train fashion-mnist --out DIR --nproc 2 --set seed=S` | "
                    "0, 1, 2 | 93.20 ± 0.20 % | 93.90 % | 29.0 min | AMD EPYC, 2 cores | 2026-12-05 |"]


def test_a_seed_run_on_an_avx2_cpu_of_the_same_name_is_a_row_of_its_own(tmp_path):
    """"AMD EPYC" names a Zen 4 with AVX-512 and a Zen 3 with AVX2 alike: a seed run on the AVX2 one (its
    record's WHERE ends in -avx2) is not averaged, minutes included, with the AVX-512 one's seeds."""
    for f in FIXTURES.glob("recipe-fashion-mnist_*_2026-12-05_seed*.json"):
        shutil.copy(f, tmp_path / f.name)
    seed0 = next(tmp_path.glob("recipe-fashion-mnist_*_2026-12-05_seed0.json"))
    d = json.loads(seed0.read_text())
    d.update(seed=3, command=d["command"].replace("seed=0", "seed=3"), test_top1=90.0, train_minutes=70.0)
    (tmp_path / "recipe-fashion-mnist_amd-epyc-avx2_2026-12-05_seed3.json").write_text(json.dumps(d))
    rows = render.recipe_seeds(records.records(tmp_path)).splitlines()[2:]
    assert len(rows) == 2
    avx512 = next(r for r in rows if "| AMD EPYC, 2 cores |" in r)
    avx2 = next(r for r in rows if "| AMD EPYC (AVX2), 2 cores |" in r)
    assert "| 0, 1, 2 | 93.20 ± 0.20 % | 93.90 % | 29.0 min |" in avx512
    assert "| 3 | 90.00 % | 93.60 % | 70.0 min |" in avx2
    assert records.isa_suffix("amd-epyc-avx2-proxy") == " (AVX2 proxy)"
    assert records.isa_suffix("intel-xeon") == ""
    assert records.isa_suffix("amd-epyc-zen5") == " (Zen 5)"


def test_check_finds_a_stale_table_and_rendering_fixes_it(tmp_path, capsys):
    results = tmp_path / "results"
    shutil.copytree(FIXTURES, results)
    doc = tmp_path / "doc.md"
    doc.write_text("# x\n\n<!-- table:agreement amd-epyc 2026-12-02 -->\n| old |\n<!-- /table -->\n\ntext\n")
    assert render.main(["--check", "--results", str(results), str(doc)]) == 1
    assert "| old |" in doc.read_text() and str(doc) in capsys.readouterr().out
    assert render.main(["--results", str(results), str(doc)]) == 0
    text = doc.read_text()
    assert "| old |" not in text and "99.78 %" in text and text.endswith("<!-- /table -->\n\ntext\n")
    assert render.main(["--check", "--results", str(results), str(doc)]) == 0


def test_a_marker_without_records_is_an_error(tmp_path, capsys):
    doc = tmp_path / "doc.md"
    doc.write_text("<!-- table:speed intel-xeon 2030-01-01 -->\n<!-- /table -->\n")
    assert render.main(["--check", "--results", str(FIXTURES), str(doc)]) == 2
    assert "infer-b1_intel-xeon_2030-01-01" in capsys.readouterr().err
    doc.write_text("<!-- table:nope -->\n<!-- /table -->\n")
    assert render.main(["--check", "--results", str(FIXTURES), str(doc)]) == 2
    assert "no table 'nope'" in capsys.readouterr().err


def set_items(command: str) -> list[str]:
    """The KEY=VALUE items of a command's `--set`s, as the shell passes them."""
    words = shlex.split(command)
    return [value for flag, value in zip(words, words[1:], strict=False) if flag == "--set"]


def training_settings(config: dict) -> dict:
    """A config's settings by dotted key (the settings it predates at their defaults), but those that say
    where files are kept (records.NOT_TRAINING)."""
    config = json.loads(TrainConfig.from_dict(config).to_json())
    return {k: v for k, v in records.dotted_items(config) if k not in records.NOT_TRAINING}


def test_the_tables_commands_train_what_each_record_trained():
    """The tables' contract: for every recipe record with a config whose recipe exists, the `--set`s of the
    command its row shows (and of its seed-table command, its seed put back), given to today's recipe,
    resolve to the config the run trained."""
    checked = []
    for path in sorted((ROOT / "benchmarks" / "results").glob("recipe-*.json")):
        d = json.loads(path.read_text())
        if "config" not in d or d["recipe"] not in RECIPES:
            continue
        assert records.reproducing_sets(d) is not None, path.name
        want = training_settings(d["config"])
        seed = str(d["config"]["seed"])
        for command in (records.run_command(d), records.seeds_command(d).replace("seed=S", f"seed={seed}")):
            got = json.loads(get_recipe(d["recipe"], set_items(command)).to_json())
            assert training_settings(got) == want, (path.name, command)
        checked.append(path.name)
    assert len(checked) >= 30


def fashion_mnist_record(seed: int, out: str, typed: str = "", sets: tuple[str, ...] = (), **fields) -> dict:
    """A record of a 2-process fashion-mnist run that typed `typed` and trained the recipe with `sets`."""
    config = json.loads(get_recipe("fashion-mnist", [f"seed={seed}", *sets]).to_json())
    return {"command": f"vitkit train fashion-mnist --out {out} --nproc 2 --set seed={seed}{typed}",
            "machine": {"cpu": "AMD EPYC", "cores": 2, "processes": 2, "threads": 1},
            "recipe": "fashion-mnist", "seed": seed, "val_split": "holdout", "config": config, **fields}


def test_a_record_renders_the_set_of_the_one_setting_its_config_changes():
    """The command comes from what the run trained, not from what was typed: a config that differs from the
    recipe in one model setting renders exactly that `--set`, and a typed `--set` of the recipe's own value
    renders none."""
    d = fashion_mnist_record(4, "runs/x", sets=("model.mlp_dim=512",))
    assert records.run_command(d) == ("vitkit train fashion-mnist --out runs/x --nproc 2 --set seed=4 "
                                      "--set model.mlp_dim=512")
    assert records.seeds_command(d) == ("vitkit train fashion-mnist --out DIR --nproc 2 --set seed=S "
                                        "--set model.mlp_dim=512")
    epochs = get_recipe("fashion-mnist").epochs
    d = fashion_mnist_record(4, "runs/x", typed=f" --set epochs={epochs}", sets=(f"epochs={epochs}",))
    assert records.run_command(d) == "vitkit train fashion-mnist --out runs/x --nproc 2 --set seed=4"
    # a setting that says where files are kept is not part of what the run trained
    d["config"]["keep_last"] += 3
    assert records.run_command(d) == "vitkit train fashion-mnist --out runs/x --nproc 2 --set seed=4"


def test_the_sets_read_back_as_the_values_of_the_config():
    """Booleans, floats, sizes, lists, strings and a setting that another implies (pool=gap drops the class
    token) are written so that `--set` reads back the config."""
    sets = ("compile=false", "optim.lr=0.0037", "optim.betas=0.9,0.95", "model.image_size=32",
            "model.pool=gap", "epochs=30", "augment.randaugment=2,9", "data.val_split=test",
            "teacher=runs/t/best")
    d = fashion_mnist_record(1, "runs/y", sets=sets)
    rendered = set_items(records.run_command(d))
    assert "model.class_token=false" in rendered and "epochs=30" in rendered
    got = json.loads(get_recipe("fashion-mnist", rendered).to_json())
    assert training_settings(got) == training_settings(d["config"])


def test_seeds_of_one_training_are_one_row_whatever_their_commands_typed(tmp_path):
    """Two runs that differ only in seed and folder are one row of the seed table; so is a third whose typed
    command names its setting no more (as runs of a recipe whose default has since changed), and a run that
    trained something else is a row of its own."""
    runs = [fashion_mnist_record(0, "runs/a", " --set model.mlp_dim=512", ("model.mlp_dim=512",),
                                 test_top1=93.0, best_val_top1=93.5, train_minutes=20.0),
            fashion_mnist_record(1, "runs/b", " --set model.mlp_dim=512", ("model.mlp_dim=512",),
                                 test_top1=93.4, best_val_top1=93.9, train_minutes=22.0)]
    (tmp_path / "recipe-fashion-mnist_amd-epyc_2026-12-08_s0.json").write_text(json.dumps(runs[0]))
    (tmp_path / "recipe-fashion-mnist_amd-epyc_2026-12-08_s1.json").write_text(json.dumps(runs[1]))
    rows = render.recipe_seeds(records.records(tmp_path)).splitlines()[2:]
    assert rows == ["| `fashion-mnist` | `vitkit train fashion-mnist --out DIR --nproc 2 --set seed=S --set "
                    "model.mlp_dim=512` | 0, 1 | 93.20 ± 0.28 % | 93.70 % | 21.0 min | AMD EPYC, 2 cores | "
                    "2026-12-08 |"]
    plain = fashion_mnist_record(2, "runs/c", "", ("model.mlp_dim=512",), test_top1=93.2, best_val_top1=93.7,
                                 train_minutes=21.0)
    other = fashion_mnist_record(3, "runs/d", "", ("model.mlp_dim=384",), test_top1=92.0, best_val_top1=92.5,
                                 train_minutes=19.0)
    (tmp_path / "recipe-fashion-mnist_amd-epyc_2026-12-08_s2.json").write_text(json.dumps(plain))
    (tmp_path / "recipe-fashion-mnist_amd-epyc_2026-12-08_s3.json").write_text(json.dumps(other))
    rows = render.recipe_seeds(records.records(tmp_path)).splitlines()[2:]
    assert len(rows) == 2
    assert "--set model.mlp_dim=512` | 0, 1, 2 | 93.20 ± 0.20 % |" in rows[1]
    assert "--set model.mlp_dim=384` | 3 | 92.00 % |" in rows[0]
