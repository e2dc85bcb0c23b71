"""Every `lbt` command in the command blocks of README.md and docs/*.md works, in a short form: no drift.

train, study and probe commands are composed and checked as they would run (`--cfg job`: the same one-line
checks of every job and of the probe's settings, nothing trained; a probe's runs are tests/test_probe.py's);
tune commands lay out their grid (every cell composed and checked against the command, no trial run); plan
commands profile briefly; report commands read a small study. Placeholders (`runs/train/<time>`, a study
folder) become folders made here. The own-model page's worked example runs for real in
tests/test_own_model.py, and lines with `...` are fragments of the command above them. The README's links
into docs/ (and the docs' links to each other) must lead somewhere.
"""

import math
import re
from pathlib import Path

import pytest
from conftest import train
from test_own_model import own_model_block

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
KINDS = {"train", "study", "probe", "tune", "report", "plan"}


def page_commands(text: str) -> list[str]:
    """`lbt ...` lines of a page's ```bash blocks, continuations joined and comments cut (the own-model
    example left to tests/test_own_model.py)."""
    own = own_model_block()
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        if block == own:
            continue
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"\s+#.*$", "", line).strip()
            if line.startswith("lbt ") and "..." not in line:
                commands.append(" ".join(line.split()))
    return commands


def documented_commands() -> dict[str, str]:
    """Every command of README.md and docs/*.md, once, with the first page that shows it."""
    found: dict[str, str] = {}
    for page in PAGES:
        for command in page_commands(page.read_text()):
            found.setdefault(command, str(page.relative_to(REPO)))
    return found


COMMANDS = documented_commands()


def test_the_readme_and_docs_have_commands_of_every_kind():
    readme = page_commands((REPO / "README.md").read_text())
    assert {c.split()[1] for c in readme} >= KINDS  # each task section of the README shows its command
    assert {c.split()[1] for c in COMMANDS} >= KINDS
    # The docs' pages hold commands the README does not, and they are checked too.
    assert any(page.startswith("docs/") for page in COMMANDS.values())


def anchor(heading: str) -> str:
    """GitHub's anchor of a markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_links_between_the_readme_and_docs_lead_somewhere():
    linked = set()
    for page in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"[a-z]+:", target):
                continue  # a web address
            path, _, fragment = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            assert file.is_file(), f"{page.relative_to(REPO)}: {target}"
            linked.add(file)
            if fragment:
                headings = re.findall(r"^#+ (.+)$", file.read_text(), re.M)
                assert fragment in {anchor(h) for h in headings}, f"{page.relative_to(REPO)}: {target}"
    assert set(PAGES[1:]) <= linked, "docs/ pages no page links to"


@pytest.fixture(scope="module")
def placeholders(tmp_path_factory):
    """A study folder (result.json files, its report) and a run's result.json, for the commands that read them."""
    import json

    from conftest import compose_config
    from test_study import _job

    from lbt.apps.report import write_report

    root = tmp_path_factory.mktemp("readme")
    study = root / "study"
    config = compose_config(["data=synthetic", "model=mlp"])[0]
    for n, (world_size, accs) in enumerate([(1, [0.8, 0.95]), (4, [0.7, 0.93]), (16, [0.5, 0.9])]):
        _job(study / str(n), "baseline", world_size, 0, accs, b_simple=200.0, test=accs[-1])
        result = study / str(n) / "result.json"
        result.write_text(json.dumps({**json.loads(result.read_text()), "config": config}))
    write_report(study)
    run = root / "run"
    train(run, ["trainer.max_steps=3"])
    return {"study": study, "result": run / "result.json", "root": root}


def short_form(command: str, places: dict, tmp_path: Path) -> list[str]:
    args = command.split()[1:]
    args = [re.sub(r"runs/train/<time>/result\.json", str(places["result"]), a) for a in args]
    args = [re.sub(r"runs/(study|multirun)/[^ ]+", str(places["study"]), a) for a in args]
    kind = args[0]
    if kind in ("train", "study", "probe") and not any(a.startswith("--cfg") for a in args):
        return args + ["--cfg", "job"]
    if kind == "plan":  # a brief profile at a small per-worker batch, unless the command reads a run's time
        given = {a.split("=", 1)[0] for a in args[1:]}
        brief = {"plan.repeats": "1", "plan.max_workers": "8", "plan.out": str(tmp_path / "plan.png")}
        if not given & {"plan.from_result", "trainer.per_worker_batch"}:
            brief["trainer.per_worker_batch"] = "4"
        return [a for a in args if a.split("=", 1)[0] not in brief] + [f"{k}={v}" for k, v in brief.items()]
    return args


def check_tune_grid(args: list[str]) -> None:
    """The grid a tune command lays out is the one it asks for: every swept value of every key, each
    combination once, each cell's config holding its values, and the command's tune.* settings."""
    from lbt.apps.tune.grid import tune_grid

    grid = tune_grid(args)
    swept: dict[str, set[str]] = {}
    for cell in grid.cells:
        for axis in cell.axes:
            key, value = axis.split("=", 1)
            swept.setdefault(key, set()).add(value)
            node = cell.recipe if key == "recipe" else cell.config
            for part in [] if key == "recipe" else key.split("."):
                node = node[part]
            assert str(node) == value, f"{cell.name}: {key}={node}"
    assert len({cell.name for cell in grid.cells}) == len(grid.cells) == math.prod(map(len, swept.values()))
    for key, value in (arg.split("=", 1) for arg in args):
        if key.startswith("tune."):
            setting = getattr(grid.settings, key.removeprefix("tune."))
            if key == "tune.dir":
                assert setting == Path(value).absolute()
            else:  # a number, or the metric by its name
                assert str(getattr(setting, "name", setting)) == value, key
        elif "," in value or key in swept:
            assert swept[key] == set(value.split(",")), key
        else:
            assert f"{key}={value}" in grid.fixed, key


# Sixty commands, each composed (a sweep's or a tune grid's every job) or run briefly: a minute of the fast lane's
# budget, so they run with the slow tests.
@pytest.mark.slow
@pytest.mark.parametrize("command", [pytest.param(c, id=f"{page}: {c}") for c, page in COMMANDS.items()])
def test_documented_command(command, placeholders, tmp_path, monkeypatch, capsys):
    """In this process (`lbt.apps.cli.main`, as `lbt` runs it), from an empty folder."""
    from lbt.apps.cli import main

    args = short_form(command, placeholders, tmp_path)
    if args[0] == "tune":
        check_tune_grid(args[1:])
        return
    monkeypatch.chdir(tmp_path)
    code = 0
    try:
        main(args)
    except SystemExit as done:
        code = done.code or 0
    out, err = capsys.readouterr()
    assert code == 0, f"{' '.join(args)}\n{err[-2000:]}"
    assert "Traceback" not in err
    if args[0] in ("train", "study", "probe"):
        assert "dist:" in out or "hydra:" in out  # a composed config was printed
    if args[0] == "probe":
        assert out.startswith("probe:")  # the probe's own settings, above its base run's
    if args[0] == "report":
        assert "## How many GPUs?" in out
