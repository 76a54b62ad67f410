"""Every `vitkit ...` command line in README.md, CONTRIBUTING.md, docs/*.md and the READMEs of benchmarks/
names a real command with options that command accepts (checked against the command line's own definition,
without running anything), every `vitkit train` line sets only what its recipe takes, and every repository
path and link they name exists."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import typer

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md")),
        ROOT / "benchmarks" / "README.md", ROOT / "benchmarks" / "results" / "README.md"]
PATH_PREFIXES = ("src/", "docs/", "benchmarks/", "tests/", "scripts/")
PATH_SUFFIXES = (".py", ".md", ".sh", ".json")
FENCE = re.compile(r"^```([^\n]*)\n(.*?)^```", re.S | re.M)
INLINE = re.compile(r"`([^`\n]+(?:\n[^`\n]+)?)`")
LINK = re.compile(r"\]\(([^)\s]+)\)|<img src=\"([^\"]+)\"")
PLACEHOLDER = re.compile(r"^[A-Z][A-Z0-9_.]*(\.\.\.)?$|^\[.*\]$|^\.\.\.$")


def cli():
    """The `vitkit` command as a click group (typer may carry its own copy of click: duck-typed below)."""
    from vitkit.cli.main import app

    return typer.main.get_command(app)


def command_lines(text: str) -> list[str]:
    """The vitkit command lines of a Markdown text: lines of fenced blocks and inline code spans that start
    with `vitkit ` (or run `-m vitkit.cli.main`), continuation lines joined and `$ ` prompts dropped. In a
    `text` block (a command's output) only the prompted lines count."""
    lines = []
    for lang, block in FENCE.findall(text):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.strip()
            if lang.strip() != "text" or line.startswith("$ "):
                lines.append(line.removeprefix("$ "))
    prose = FENCE.sub("", text)
    lines += [" ".join(span.split()) for span in INLINE.findall(prose)]
    found = []
    for line in lines:
        if " -m vitkit.cli.main " in line:
            line = "vitkit " + line.split(" -m vitkit.cli.main ", 1)[1]
        if line.startswith("vitkit ") or line == "vitkit":
            found.append(line)
    return found


def words(line: str) -> list[str]:
    try:
        return shlex.split(line.replace("\\|", "|"), comments=True)
    except ValueError:  # an unbalanced quote inside a table cell: fall back to plain splitting
        return line.split("#")[0].split()


def option_names(command) -> set[str]:
    names = {"--help", "-h"}
    for param in command.params:
        names.update(getattr(param, "opts", ()))
        names.update(getattr(param, "secondary_opts", ()))
    return names


def problems(line: str, root) -> list[str]:
    """What is wrong with one command line: an unknown command or an option its command does not take."""
    tokens = [t.strip("[]") for t in words(line)[1:]]
    command = root
    path = ["vitkit"]
    rest = list(tokens)
    while hasattr(command, "commands") and rest:
        word = rest[0]
        if word.startswith("-"):
            break
        if PLACEHOLDER.match(word):  # `vitkit COMMAND --help`, `vitkit analyze KIND CKPT`: nothing to resolve
            return []
        if word not in command.commands:
            return [f"{' '.join(path)} has no command {word!r}"]
        command = command.commands[word]
        path.append(word)
        rest.pop(0)
    known = option_names(command)
    bad = []
    for token in rest:
        if token in ("-", "--") or not token.startswith("-") or re.match(r"^-\d", token):
            continue
        if token.startswith("-") and "|" in token:  # `--to vitkit|timm|hf` is a value, `-b|--batch` no option
            continue
        name = token.split("=", 1)[0]
        if name not in known:
            bad.append(f"`{' '.join(path)}` takes no option {name}")
    return bad


# `--set` keys whose values name the reader's own files: a documented command cannot have them here
FILE_SETTINGS = ("init", "teacher")


def recipe_settings(line: str) -> tuple[str, list[str]] | None:
    """For a `vitkit train RECIPE ...` line: the recipe and its `--set KEY=VALUE` overrides, less those whose
    value is a placeholder (`seed=S`), a shell variable (`compile=$c`) or one of the reader's files; None for
    other lines."""
    from vitkit.train.recipes import RECIPES

    tokens = words(line)[1:]
    if len(tokens) < 2 or tokens[0] != "train" or tokens[1] not in RECIPES:
        return None
    sets = [tokens[i + 1] for i, t in enumerate(tokens[:-1]) if t == "--set"]
    sets += [t.split("=", 1)[1] for t in tokens if t.startswith("--set=")]
    kept = [kv for kv in sets if "=" in kv and kv.split("=", 1)[0] not in FILE_SETTINGS
            and "$" not in kv and not PLACEHOLDER.match(kv.split("=", 1)[1])]
    return tokens[1], kept


def settings_problems(line: str) -> list[str]:
    """What the recipe refuses among a `vitkit train` line's `--set` overrides (a key it lacks, a value of the
    wrong type), checked as the command checks them, before anything runs."""
    from vitkit.train import get_recipe

    found = recipe_settings(line)
    if not found or not found[1]:
        return []
    try:
        get_recipe(*found)
    except ValueError as e:
        return [str(e).splitlines()[0]]
    return []


def repo_paths(text: str) -> list[str]:
    """Repository paths the text names in code: words that start with a top-level folder of the repository."""
    spans = INLINE.findall(FENCE.sub("", text)) + [block for _, block in FENCE.findall(text)]
    found = []
    for span in spans:
        for word in re.split(r"[\s,;:()=\"']+", span):
            word = word.rstrip(".")
            if not word.startswith(PATH_PREFIXES) or any(c in word for c in "*<>[]{}$…") or "..." in word:
                continue
            if re.search(r"(^|/)(?!README)[A-Z][A-Z_]*[A-Z](\.|/|$)", word):  # `src/vitkit/convert/NAME.py`
                continue
            if "/" in word[:-1] or word.endswith(PATH_SUFFIXES):
                found.append(word)
    return found


def link_targets(doc: Path, text: str) -> list[Path]:
    targets = []
    for link, src in LINK.findall(text):
        target = (link or src).split("#")[0]
        if target and not re.match(r"^[a-z]+:", target):
            targets.append((doc.parent / target).resolve())
    return targets


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_command_line_names_a_real_command_and_options(doc):
    if not doc.exists():
        pytest.skip(f"{doc.name} not written yet")
    root = cli()
    lines = command_lines(doc.read_text())
    bad = [f"{line!r}: {p}" for line in lines for p in problems(line, root)]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_training_command_sets_what_its_recipe_takes(doc):
    if not doc.exists():
        pytest.skip(f"{doc.name} not written yet")
    bad = [f"{line!r}: {p}" for line in command_lines(doc.read_text()) for p in settings_problems(line)]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_path_and_link_exists(doc):
    if not doc.exists():
        pytest.skip(f"{doc.name} not written yet")
    text = doc.read_text()
    missing = [p for p in repo_paths(text) if not (ROOT / p).exists()]
    missing += [str(t.relative_to(ROOT)) for t in link_targets(doc, text) if not t.exists()]
    assert not missing, f"{doc.name} names paths that do not exist: {missing}"


def test_the_checks_catch_what_they_are_for():
    root = cli()
    assert problems("vitkit train demo --out runs/x --resume --set a=b", root) == []
    assert problems("vitkit analyze posemb runs/demo/best -o x.png", root) == []
    assert problems("vitkit COMMAND --help", root) == []
    assert problems("vitkit trian demo", root) == ["vitkit has no command 'trian'"]
    assert problems("vitkit eval ckpt --data x --no-such-option", root) == [
        "`vitkit eval` takes no option --no-such-option"
    ]
    assert problems("vitkit analyze posemb x --data y", root) == [
        "`vitkit analyze posemb` takes no option --data"
    ]
    assert settings_problems("vitkit train demo --out x --set model.spt=true --set seed=S") == []
    line = "vitkit train demo --set seed=S --set compile=$c --set teacher=m --set epochs=2"
    assert recipe_settings(line) == ("demo", ["epochs=2"])
    assert "sptx" in settings_problems("vitkit train demo --out x --set model.sptx=true")[0]
    assert "optim.lr" in settings_problems("vitkit train fashion-mnist --set optim.lr=fast")[0]
    text = (
        "Run `vitkit models S/16`.\n\n```bash\nvitkit eval a \\\n  --data b   # note\n$ vitkit info c\n```\n"
        "```text\n$ vitkit models\n   vitkit presets\n```\n"
    )
    assert command_lines(text) == [
        "vitkit eval a    --data b   # note",
        "vitkit info c",
        "vitkit models",
        "vitkit models S/16",
    ]
    assert repo_paths("see `benchmarks/records.py` and `src/vitkit/x/`, `docs/*.md`, `tests/NAME.py`") == [
        "benchmarks/records.py",
        "src/vitkit/x/",
    ]
