"""The tables of README.md and docs/*.md are what benchmarks/render_tables.py renders from
benchmarks/results/; the renderer itself is checked on small records under tests/fixtures/records."""

import importlib.util
import json
import shutil
import sys
from pathlib import Path

import pytest

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


def test_names_and_slugs():
    assert records.slug("AMD EPYC") == "amd-epyc"
    assert records.slug("Intel(R) Xeon(R) Processor") == "intel-xeon"
    assert records.slug("AMD EPYC 9454 48-Core Processor") == "amd-epyc-9454"
    assert records.slug("Intel(R) Xeon(R) Platinum 8480+ CPU @ 2.00GHz") == "intel-xeon-platinum-8480"
    assert records.slug("NVIDIA H200") == "nvidia-h200"
    # the same model name with and without AVX-512
    assert records.machine_slug("AMD EPYC", {"avx", "avx2", "fma"}) == "amd-epyc-avx2"
    assert records.machine_slug("AMD EPYC", {"avx2", "avx512f", "avx512_vnni"}, hold="") == "amd-epyc"
    # an AVX-512 CPU held to AVX2 (VITKIT_CPU_ISA=avx2): a proxy, not the CPU's own records
    assert records.machine_slug("AMD EPYC", {"avx2", "avx512f"}, hold="avx2") == "amd-epyc-avx2-proxy"
    assert records.machine_slug("AMD EPYC", {"avx", "avx2", "fma"}, hold="avx2") == "amd-epyc-avx2"
    assert records.machine_slug("Neoverse-V2", {"sve", "asimd"}) == "neoverse-v2"
    path = records.record_path("infer-b1", "amd-epyc", "2026-12-02", "run1", folder=Path("x"))
    assert path == Path("x/infer-b1_amd-epyc_2026-12-02_run1.json")
    rec = records.Record.parse(path)
    assert (rec.what, rec.where, rec.date, rec.tag) == ("infer-b1", "amd-epyc", "2026-12-02", "run1")
    with pytest.raises(ValueError):
        records.record_path("Infer B1", "amd-epyc", "2026-12-02")
    with pytest.raises(ValueError):
        records.Record.parse(Path("s26_run1_b1.json"))


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
