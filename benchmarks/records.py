"""Benchmark records: where they live and how they are named (benchmarks/results/README.md has the schema),
and the command that trains what a recipe record's run trained.

A record is one measurement, one JSON file named by what was measured, where, and when:
`WHAT_WHERE_DATE[_TAG].json`, e.g. `infer-b1_amd-epyc_2026-12-02_run1.json`. WHERE is the CPU (or GPU) model
as a slug of `lscpu`'s "Model name", with `-avx2` added for an x86 CPU without AVX-512 (a virtual machine's
"AMD EPYC" names a Zen 4 with AVX-512 and a Zen 3 with AVX2 alike) and `-zen5` for an AMD CPU of family 26
(a Zen 5, whose AVX-512 runs at full width where a Zen 4's is two halves); DATE is the day of the measurement
(YYYY-MM-DD); TAG tells apart several measurements of one kind on one day (`run1`, `seed1`). An AVX-512 CPU
held to AVX2 (VITKIT_CPU_ISA=avx2, the AVX2 proxy of CONTRIBUTING.md) is WHERE `<cpu>-avx2-proxy`.

    python benchmarks/records.py name infer-b1 --tag run1     # the path a new record of this machine gets
    python benchmarks/records.py where                        # this machine's CPU slug
    python benchmarks/records.py slug "NVIDIA H200"           # nvidia-h200
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
NAME = re.compile(
    r"^(?P<what>[a-z0-9-]+)_(?P<where>[a-z0-9-]+)_(?P<date>\d{4}-\d{2}-\d{2})(?:_(?P<tag>[a-z0-9-]+))?$"
)


def slug(model_name: str) -> str:
    """`Intel(R) Xeon(R) Processor` -> `intel-xeon`, `AMD EPYC 9454 48-Core Processor` -> `amd-epyc-9454`,
    `NVIDIA H200` -> `nvidia-h200`: lower case; trademarks, clock, core count, "processor", "cpu" dropped."""
    s = model_name.lower()
    s = re.sub(r"\((r|tm)\)", " ", s)
    s = re.sub(r"@.*$", " ", s)  # the clock: "CPU @ 2.10GHz"
    s = re.sub(r"\b\d+-core\b|\bprocessor\b|\bcpu\b", " ", s)
    return re.sub(r"[^a-z0-9]+", "-", s).strip("-") or "unknown-cpu"


def cpuinfo(key: str) -> str | None:
    """The first value of `key` in /proc/cpuinfo ("flags", "model name", "cpu family"); None where it is
    not there or the file cannot be read."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            name, _, value = line.partition(":")
            if name.strip().lower() == key:
                return value.strip()
    except OSError:
        pass
    return None


def cpu_flags() -> set[str]:
    """This machine's CPU feature flags (/proc/cpuinfo's "flags"); empty where they cannot be read."""
    return set((cpuinfo("flags") or "").split())


# WHERE's endings for the vector extension, and what each names in a table: an AVX2-only CPU, an AVX-512 CPU
# held to AVX2.
AVX2, AVX2_PROXY, ZEN5 = "-avx2", "-avx2-proxy", "-zen5"
ISA_LABELS = {AVX2_PROXY: "AVX2 proxy", AVX2: "AVX2", ZEN5: "Zen 5"}
AMD_ZEN5_FAMILY = 26  # 0x1A: Zen 5 (Turin); family 25 covers Zen 3 and Zen 4, told apart by AVX-512


def cpu_family() -> tuple[str, int | None]:
    """This machine's CPU vendor and family (/proc/cpuinfo's "vendor_id", "cpu family"); ("", None) where
    they cannot be read."""
    family = cpuinfo("cpu family")
    return cpuinfo("vendor_id") or "", int(family) if family and family.isdigit() else None


def machine_slug(model_name: str | None = None, flags: set[str] | None = None,
                 hold: str | None = None, family: tuple[str, int | None] | None = None) -> str:
    """This machine's WHERE: the slug of its CPU model, `-zen5` added for an AMD CPU of family 26 and `-avx2`
    where the CPU has AVX2 but not AVX-512 (the same model name covers all three kinds under some
    hypervisors), `-avx2-proxy` where an AVX-512 CPU is held to AVX2 (`hold`, default $VITKIT_CPU_ISA;
    CONTRIBUTING.md): its records are not this CPU's own. `family` is (vendor, family), default this CPU's."""
    flags = cpu_flags() if flags is None else flags
    hold = os.environ.get("VITKIT_CPU_ISA", "") if hold is None else hold
    vendor, number = cpu_family() if family is None else family
    zen5 = ZEN5 if vendor == "AuthenticAMD" and number == AMD_ZEN5_FAMILY else ""
    if "avx512f" in flags:
        isa = AVX2_PROXY if hold.strip().lower() == "avx2" else ""
    else:
        isa = AVX2 if "avx2" in flags else ""
    return slug(cpu_model() if model_name is None else model_name) + zen5 + isa


def isa_suffix(where: str) -> str:
    """" (AVX2)", " (AVX2 proxy)" or " (Zen 5)" where WHERE (`machine_slug`'s) ends in one of ISA_LABELS, else
    "": one CPU model name covers AVX-512 and AVX2 CPUs alike, and their runs differ."""
    return next((f" ({label})" for end, label in ISA_LABELS.items() if where.endswith(end)), "")


def cpu_model() -> str:
    """This machine's CPU model, as `lscpu` names it ("Model name"; /proc/cpuinfo's "model name")."""
    model = cpuinfo("model name")
    if model is not None:
        return model
    import platform

    return platform.processor() or "unknown CPU"


def record_path(
    what: str,
    where: str | None = None,
    date: str | None = None,
    tag: str | None = None,
    folder: Path = RESULTS,
) -> Path:
    """The file a record of `what` gets: WHERE defaults to `machine_slug()`, DATE to today (UTC)."""
    where = where or machine_slug()
    date = date or datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    stem = f"{what}_{where}_{date}" + (f"_{tag}" if tag else "")
    if not NAME.match(stem):
        raise ValueError(f"{stem!r} is not a record name WHAT_WHERE_DATE[_TAG] (lower case, digits, '-')")
    return folder / f"{stem}.json"


@dataclass(frozen=True)
class Record:
    """A record file's name, read: what, where, date and tag."""

    path: Path
    what: str
    where: str
    date: str
    tag: str

    @classmethod
    def parse(cls, path: Path) -> Record:
        m = NAME.match(path.stem)
        if path.suffix != ".json" or not m:
            raise ValueError(f"{path}: not a record name WHAT_WHERE_DATE[_TAG].json")
        return cls(path, m["what"], m["where"], m["date"], m["tag"] or "")


def write_rows(rows: list[dict], path: str | Path | None) -> None:
    """Write a benchmark's `rows` as a record at `path` (nothing when None), with what makes it comparable:
    the machine, PyTorch's version and the command that made it."""
    if path is None:
        return
    import sys

    import torch

    from vitkit.bench import machine_info, write_json

    write_json({"machine": machine_info(), "torch": torch.__version__, "command": " ".join(sys.argv),
                "rows": rows}, path)


def records(folder: Path = RESULTS) -> list[Record]:
    """Every record in `folder`, sorted by name (so run1, run2, ... come in order up to run9)."""
    return sorted((Record.parse(p) for p in folder.glob("*.json")), key=lambda r: _natural(r.path.name))


def _natural(name: str) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


# Settings of a run's config that say where its files are kept, not what it trains (the recipe's own name,
# the data's folder and whether it may be downloaded, how many checkpoints stay on disk): a command that
# reproduces the run leaves them out. `seed` it gives on its own.
NOT_TRAINING = ("recipe", "data.data_dir", "data.download", "keep_last")


def dotted_items(config: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    """A nested config dict's settings as (dotted key, value) pairs, in the dict's order: the keys `--set`
    takes."""
    items = []
    for key, value in config.items():
        if isinstance(value, dict):
            items += dotted_items(value, prefix + key + ".")
        else:
            items.append((prefix + key, value))
    return items


def set_text(value: Any) -> str:
    """A config value as `--set key=VALUE` writes it, so that vitkit's override parser
    (vitkit.train.overrides.parse_value) reads back the same value: true/false, none, a list
    comma-separated, a whole float as an integer (`epochs=30`, read back as 30.0), another by repr."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return ",".join(set_text(v) for v in value)
    if isinstance(value, float):
        return str(int(value)) if value.is_integer() else repr(value)
    return str(value)


def reproducing_sets(d: dict[str, Any]) -> list[str] | None:
    """The `key=value` items with which today's recipe trains what a recipe record's run trained (its
    `config`): one per setting that differs from the recipe's, in the config's order, `seed` and NOT_TRAINING
    left out. A config that predates a setting has it at its default, as a resumed run reads it. None without
    a config, or where the recipe is gone or today's vitkit no longer reads the config."""
    if "config" not in d:
        return None
    from vitkit.train import get_recipe
    from vitkit.train.settings import TrainConfig

    try:
        recipe = dict(dotted_items(json.loads(get_recipe(d["recipe"]).to_json())))
        config = json.loads(TrainConfig.from_dict(d["config"]).to_json())
    except (ValueError, TypeError, KeyError):
        return None
    return [shlex.quote(f"{key}={set_text(value)}") for key, value in dotted_items(config)
            if key not in ("seed", *NOT_TRAINING) and value != recipe.get(key)]


def processes_of(d: dict[str, Any]) -> int:
    """How many processes a record's run trained in: its machine's `processes` (a run result's own), else
    the `--nproc` of its typed command, else 1."""
    typed = re.search(r" --nproc (\d+)", d.get("command", ""))
    return int(d.get("machine", {}).get("processes") or d.get("processes") or (typed[1] if typed else 1))


def reproducing_command(d: dict[str, Any], out: str, seed: str) -> str | None:
    """`vitkit train RECIPE --out OUT [--nproc N] --set seed=SEED` and a `--set` for each of
    reproducing_sets: what the record's run trained, under today's recipe. None where that cannot be said."""
    sets = reproducing_sets(d)
    if sets is None:
        return None
    nproc = processes_of(d)
    return " ".join([f"vitkit train {d['recipe']} --out {out}", *([f"--nproc {nproc}"] if nproc > 1 else []),
                     f"--set seed={seed}", *(f"--set {s}" for s in sets)])


def without_seed(command: str) -> str:
    """A run's command with its own folder and seed generalised: what its seeds have in common."""
    command = re.sub(r" --out \S+", " --out DIR", command)
    return re.sub(r" --set seed=\d+", "", command) + " --set seed=S"


def run_command(d: dict[str, Any]) -> str:
    """A recipe record's command for its own row: reproducing_command with the run's `--out` as typed and its
    seed; the typed command where that cannot be said."""
    typed = d.get("command", f"vitkit train {d['recipe']}")
    out = re.search(r" --out (\S+)", typed)
    return reproducing_command(d, out[1] if out else "DIR", str(d.get("config", {}).get("seed"))) or typed


def seeds_command(d: dict[str, Any]) -> str:
    """What a recipe record's run has in common with the other seeds of its training: reproducing_command with
    `--out DIR` and `seed=S`; without_seed of the typed command where that cannot be said."""
    return reproducing_command(d, "DIR", "S") or without_seed(d["command"])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    name = sub.add_parser("name", help="print the path of a new record")
    name.add_argument("what")
    name.add_argument("--tag")
    name.add_argument("--where", help="default: this machine's CPU slug")
    name.add_argument("--folder", type=Path, default=RESULTS)
    sub.add_parser("where", help="print this machine's CPU slug")
    sub.add_parser("slug", help="print the slug of a CPU or GPU model name").add_argument("model_name")
    args = parser.parse_args(argv)
    if args.command == "where":
        print(machine_slug())
    elif args.command == "slug":
        print(slug(args.model_name))
    else:
        print(record_path(args.what, args.where, tag=args.tag, folder=args.folder))


if __name__ == "__main__":
    main()
