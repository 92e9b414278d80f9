"""README.md and docs/ as a user meets them: fences balanced and tagged, relative links and anchors alive, option
tables equal to the option dataclasses, and every documented command run.

A fenced block is run unless the line before its fence marks it (docs/architecture.md lists the markers):
``<!-- docs-test: skip: REASON -->`` (a GPU, a cluster, a fragment), ``<!-- docs-test: covered: tests/f.py::test -->``
(that test runs the same command), ``<!-- docs-test: fails -->`` (the block must fail), and
``<!-- docs-test: output -->`` before a text block whose lines the block above must print. A marker is an HTML
comment, which a rendered page hides, so a skipped block also has a note the reader sees: the paragraph before its
marker is one italic sentence (``*Needs a GPU (not run by the docs tests).*``). Each page's blocks run in
order in a fresh folder of links to the repository (so ``runs/`` lands there), on CPU.
"""

from __future__ import annotations

import ast
import importlib.util
import re
import shlex
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import pytest
from zygote import Launcher

from conftest import child_env, free_port, shared_launcher

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]
FENCE = re.compile(r"^( {0,3})(`{3,}|~{3,})(.*)$")
MARKER = re.compile(r"^\s*<!-- docs-test: (skip|covered|fails|output)(?:: (.+?))? -->\s*$")
SHELL, PYTHON = {"bash", "sh", "shell"}, {"python"}
NOT_LINKED = ("runs", "data", ".git", ".venv", ".pytest_cache", "lightning_logs")
COMMAND_TIMEOUT = 900


def shown(path: Path) -> Path:
    return path.relative_to(ROOT) if path.is_relative_to(ROOT) else path


@dataclass
class Block:
    page: Path
    line: int  # 1-based line of the opening fence
    lang: str
    text: str
    marker: Optional[tuple[str, Optional[str]]] = None
    note: Optional[str] = None  # the italic paragraph right before a skip marker, as the reader sees it

    @property
    def where(self) -> str:
        return f"{shown(self.page)}:{self.line}"

    @property
    def runs(self) -> bool:
        return self.lang in SHELL | PYTHON and (self.marker is None or self.marker[0] == "fails")

    def commands(self) -> list[str]:
        """The shell commands of the block: continuation lines joined, comments and blank lines left out."""
        joined = re.sub(r"\s*\\\n\s*", " ", self.text)
        return [line.strip() for line in joined.splitlines() if line.strip() and not line.strip().startswith("#")]


@dataclass
class Page:
    path: Path
    blocks: list[Block] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    prose: list[tuple[int, str]] = field(default_factory=list)  # (line, text) outside fences


def parse(path: Path, text: Optional[str] = None) -> Page:
    """The page's fenced blocks with their markers, its prose lines, and what is wrong with its fences/markers."""
    text = path.read_text() if text is None else text
    page, lines, open_at = Page(path), text.splitlines(), None
    fence = lang = ""
    body: list[str] = []
    pending: Optional[tuple[int, tuple[str, Optional[str]]]] = None
    rel = shown(path)
    for i, line in enumerate(lines, 1):
        match = FENCE.match(line)
        if open_at is None:
            if match:
                marker = pending[1] if pending and pending[0] == i - 1 else None
                fence, lang, open_at, body = match.group(2), match.group(3).strip(), i, []
                if not lang:
                    page.problems.append(f"{rel}:{i}: a fence without a language (```bash, ```python, ```text ...)")
                page.blocks.append(Block(path, i, lang, "", marker))
                continue
            page.prose.append((i, line))
            if line.strip().startswith("<!-- docs-test"):
                found = MARKER.match(line)
                if found is None:
                    page.problems.append(f"{rel}:{i}: malformed marker {line.strip()!r}; write <!-- docs-test: "
                                         "skip: REASON -->, covered: tests/f.py::test, fails or output")
                else:
                    kind, arg = found.groups()
                    if kind in ("skip", "covered") and not arg:
                        page.problems.append(f"{rel}:{i}: {kind} needs a reason after the colon")
                    pending = (i, (kind, arg))
            elif pending and pending[0] == i - 1:
                page.problems.append(f"{rel}:{pending[0]}: a docs-test marker must be the line right before a fence")
            continue
        if match and match.group(2)[0] == fence[0] and len(match.group(2)) >= len(fence):
            if match.group(3).strip():
                page.problems.append(f"{rel}:{i}: {line.strip()!r} opens a block inside the block opened at line"
                                     f" {open_at}: a fence is missing before it")
                body.append(line)
                continue
            page.blocks[-1].text = "\n".join(l[len(match.group(1)):] if l.startswith(match.group(1)) else l
                                             for l in body) + "\n"
            open_at = None
            continue
        body.append(line)
    if open_at is not None:
        page.problems.append(f"{rel}:{open_at}: the fence opened here is never closed (unbalanced fences)")
    for before, block in zip([None, *page.blocks], page.blocks):
        kind = block.marker[0] if block.marker else None
        if kind == "output" and (block.lang != "text" or before is None or not before.runs):
            page.problems.append(f"{block.where}: an output marker belongs before a ```text block that follows a block"
                                 " the test runs")
        if kind in ("skip", "covered", "fails") and block.lang not in SHELL | PYTHON:
            page.problems.append(f"{block.where}: a {kind} marker belongs before a ```bash or ```python block")
        if block.lang in ("console", "shell-session"):
            page.problems.append(f"{block.where}: write shell commands in a ```bash block (it is run)")
        if kind == "skip":
            block.note = visible_note(lines, block.line - 1)
    return page


NOTE = re.compile(r"^(\*[^*\s](?:.*[^*\s])?\*|_[^_\s](?:.*[^_\s])?_)[.:]?$")


def visible_note(lines: list[str], marker_line: int) -> Optional[str]:
    """The paragraph before the marker on ``marker_line`` (1-based) when it is all in italics, else None."""
    at = marker_line - 2
    while at >= 0 and not lines[at].strip():
        at -= 1
    paragraph: list[str] = []
    while at >= 0 and lines[at].strip() and not lines[at].strip().startswith(("<!--", "- ", "* ", "#", "|")):
        paragraph.insert(0, lines[at].strip())
        at -= 1
    text = " ".join(paragraph)
    return text if NOTE.match(text) else None


PARSED = {path: parse(path) for path in PAGES}


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = heading.strip().lower().replace("`", "")
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Page) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for _, line in page.prose:
        if line.startswith("#"):
            base = slug(line.lstrip("#"))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


def dead_links(page: Page, pages: dict[Path, Page]) -> list[str]:
    """Relative links (files and #anchors) outside code that lead nowhere."""
    out = []
    for number, line in page.prose:
        for target in re.findall(r"\]\(([^)\s]+)\)", re.sub(r"`[^`]*`", "", line)):
            if re.match(r"^[a-z]+:", target):
                continue
            path_part, _, anchor = target.partition("#")
            dest = (page.path.parent / path_part).resolve() if path_part else page.path
            where = f"{shown(page.path)}:{number}"
            if not dest.exists():
                out.append(f"{where}: link to {target} but {path_part} does not exist")
            elif anchor:
                linked = pages.get(dest) or (parse(dest) if dest.suffix == ".md" else None)
                if linked is None or anchor not in anchors(linked):
                    out.append(f"{where}: link to {target} but {dest.name} has no heading #{anchor}")
    return out


def options_module():
    spec = importlib.util.spec_from_file_location("docs_options", DOCS / "options.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---- the checks that run in the fast suite -------------------------------------------------------------------

def test_fences_are_balanced_tagged_and_markers_placed():
    problems = [p for page in PARSED.values() for p in page.problems]
    assert not problems, "\n".join(problems)


def test_fence_check_finds_a_missing_fence_and_a_bad_marker(tmp_path):
    broken = tmp_path / "broken.md"
    text = ("```python\nx = 1\n```\n\nMegatronStrategy(\n)\n```\n\n```python\ny = 2\n```\n"
            "```text\nleft open\n")
    problems = parse(broken, text).problems
    assert any("opens a block inside the block opened at line 7" in p for p in problems), problems
    assert any("never closed" in p for p in problems), problems
    good = parse(broken, "<!-- docs-test: skip -->\n```bash\nls\n```\n```\nplain\n```\n").problems
    assert any("skip needs a reason" in p for p in good) and any("without a language" in p for p in good), good


def test_relative_links_and_anchors_resolve():
    problems = [p for page in PARSED.values() for p in dead_links(page, PARSED)]
    assert not problems, "\n".join(problems)


def test_link_check_finds_dead_files_and_anchors(tmp_path):
    (tmp_path / "other.md").write_text("# Other page\n\n## `disttrain_fsdp` and more (HSDP)\n")
    page = parse(tmp_path / "page.md", "[a](other.md#disttrain_fsdp-and-more-hsdp) [b](other.md#nope)"
                                       " [c](missing.md) [d](https://example.com) `[e](inline.md)`\n")
    problems = dead_links(page, {})
    assert len(problems) == 2 and "#nope" in problems[0] and "missing.md does not exist" in problems[1], problems


def test_option_tables_equal_the_option_dataclasses():
    options = options_module()
    classes = options.option_classes()
    problems = [p for path in options.pages() for p in options.problems(path, path.read_text(), classes)]
    assert not problems, "\n".join(problems) + "\nregenerate the tables with: python docs/options.py --write"
    named = {name for path in options.pages() for name, _, _ in options.tables(path.read_text())}
    assert named == set(classes), f"option dataclasses without a table in docs/: {sorted(set(classes) - named)}"


def test_option_table_check_names_missing_unknown_and_wrong_defaults():
    from disttrain.parallel.engines.ddp import DDPOptions

    options = options_module()
    rows = options.table(DDPOptions)
    assert rows[2].startswith("| `gradient_compression` | `None` | None, \"fp16\"")
    broken = [r for r in rows if "`static_graph`" not in r]  # a field missing
    broken = [r.replace("| `1` |", "| `4` |") if "`powersgd_rank`" in r else r for r in broken]  # a wrong default
    broken.append("| `bucket_cap_mb` | `25` | not an option |")  # an option that does not exist
    text = "\n".join(["<!-- options: DDPOptions -->", *broken, "<!-- /options -->"])
    found = options.problems(Path("x.md"), text, {"DDPOptions": DDPOptions})
    assert sorted(found) == sorted([
        "x.md:1: DDPOptions.static_graph is missing from the table",
        "x.md:1: DDPOptions.powersgd_rank shows default 4 but the dataclass has 1",
        "x.md:1: the table names option 'bucket_cap_mb', which DDPOptions does not have"]), found
    reworded = "\n".join(["<!-- options: DDPOptions -->",
                          *[r.replace("passed", "handed") if "`static_graph`" in r else r for r in rows],
                          "<!-- /options -->"])
    assert options.problems(Path("x.md"), reworded, {"DDPOptions": DDPOptions}) == [
        "x.md:1: the DDPOptions table's text differs from the DDPOptions docstring"]


def strategy_options() -> dict[str, set[str]]:
    import dataclasses

    classes = options_module().option_classes()
    lightning_args = {"accelerator", "parallel_devices", "cluster_environment", "precision_plugin", "precision",
                      "process_group_backend", "timeout", "checkpoint_io"}
    by_strategy = {"FSDPStrategy": "FSDPOptions", "DDPStrategy": "DDPOptions", "ZeroStrategy": "ZeroOptions",
                   "MegatronStrategy": "MegatronOptions", "RecsysStrategy": "RecsysOptions",
                   "AutoStrategy": "AutoOptions"}
    return {s: {f.name for f in dataclasses.fields(classes[o])} | lightning_args for s, o in by_strategy.items()}


def test_examples_pass_only_options_that_exist():
    """Every ``XStrategy(name=...)`` in a Python block or in the prose names an option of that strategy."""
    known, problems = strategy_options(), []
    for page in PARSED.values():
        calls: list[tuple[str, str, int]] = []
        for block in page.blocks:
            if block.lang in PYTHON and not (block.marker and block.marker[0] == "fails"):
                for node in ast.walk(ast.parse(block.text)):
                    if isinstance(node, ast.Call):
                        name = getattr(node.func, "attr", getattr(node.func, "id", ""))
                        calls += [(name, k.arg, block.line) for k in node.keywords if k.arg]
        for number, line in page.prose:
            for name, args in re.findall(r"(\w+Strategy)\(([^)]*)\)", line):
                calls += [(name, arg, number) for arg in re.findall(r"(\w+)=", args)]
        for name, arg, number in calls:
            if name in known and arg not in known[name]:
                problems.append(f"{page.path.relative_to(ROOT)}:{number}: {name}({arg}=...) is not an option of"
                                f" {name}")
    assert not problems, "\n".join(problems)


def table_rows(path: Path, header: str) -> list[list[str]]:
    lines = path.read_text().splitlines()
    start = lines.index(header)
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip().strip("`") for c in line.strip("|").split("|")])
    return rows


def test_strategy_tables_are_the_registered_names():
    import disttrain  # noqa: F401  (registers the names)
    from lightning.fabric.strategies import STRATEGY_REGISTRY
    from lightning.pytorch.strategies import StrategyRegistry

    registered = {n for n in StrategyRegistry.available_strategies() if n.startswith("disttrain_")}
    readme = [row[0] for row in table_rows(ROOT / "README.md", "| name | what |")]
    assert sorted(readme) == sorted(registered) and len(readme) == len(set(readme))
    for name, cls, defaults in table_rows(DOCS / "strategies.md", "| name | class | registered with |"):
        for registry in (StrategyRegistry, STRATEGY_REGISTRY):
            entry = registry[name]
            assert entry["strategy"].__name__ == cls, (name, entry["strategy"])
            shown = {} if defaults.startswith("defaults") else dict(
                (k.strip(), ast.literal_eval(v)) for k, v in (part.split("=") for part in defaults.split(", ")))
            assert entry["init_params"] == shown, (name, entry["init_params"], shown)


COMPARISON_HEADER = "| what | disttrain | Lightning's own strategies | torchtitan | accelerate | DeepSpeed |"


def comparison_problems(path: Path) -> list[str]:
    """Each disttrain cell of the comparison table names a test (a link to its file, the test's name as the link
    text) that exists."""
    problems = []
    for row in table_rows(path, COMPARISON_HEADER):
        claim = row[1]
        found = re.search(r"\[`?(test_\w+)`?\]\(\.\./(tests/test_\w+\.py)\)", claim)
        if found is None:
            problems.append(f"{row[0]!r}: the disttrain cell names no test ([`test_name`](../tests/test_file.py))")
            continue
        name, file = found.groups()
        tests = {n.name for n in ast.walk(ast.parse((ROOT / file).read_text())) if isinstance(n, ast.FunctionDef)}
        if name not in tests:
            problems.append(f"{row[0]!r}: {file} has no {name}")
    return problems


def test_the_comparison_names_a_test_for_every_disttrain_claim(tmp_path):
    assert len(table_rows(DOCS / "comparison.md", COMPARISON_HEADER)) >= 6
    assert comparison_problems(DOCS / "comparison.md") == []
    broken = tmp_path / "comparison.md"
    broken.write_text(f"{COMPARISON_HEADER}\n|---|---|---|---|---|---|\n"
                      "| a | yes ([`test_nothing_here`](../tests/test_docs.py)) | | | | |\n| b | yes | | | | |\n")
    assert comparison_problems(broken) == [
        "'a': tests/test_docs.py has no test_nothing_here",
        "'b': the disttrain cell names no test ([`test_name`](../tests/test_file.py))"]


def test_make_demo_runs_the_documented_command():
    """The README says what `make demo` runs; the dialogue page shows that command (with fewer steps), run by this
    test or by the test its marker names."""
    makefile = (ROOT / "Makefile").read_text()
    lines = makefile.split("\ndemo:", 1)[1].split("\n")[1:]
    recipe = " ".join(line.strip().rstrip("\\").strip() for line in lines[:next(
        i + 1 for i, line in enumerate(lines) if not line.rstrip().endswith("\\"))]).replace("$(VENV)/bin/", "")
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert recipe in readme, f"README.md does not show the command make demo runs: {recipe}"
    page = PARSED[DOCS / "recipes" / "dialogue-llm.md"]
    shown = [c for b in page.blocks if b.lang in SHELL and (b.runs or b.marker[0] == "covered") for c in b.commands()]
    assert any(c.startswith(recipe + " ") for c in shown), (recipe, shown)


# ---- covered and skipped blocks ------------------------------------------------------------------------------

def marked(kind: str) -> list[Block]:
    return [b for page in PARSED.values() for b in page.blocks if b.marker and b.marker[0] == kind]


LAUNCHER_OPTIONS = ("--accelerator", "--devices", "--strategy", "--precision", "--main-port")


@pytest.mark.parametrize("block", marked("covered"), ids=lambda b: b.where)
def test_covered_blocks_name_a_test_that_runs_their_command(block):
    """The named test exists, and its module passes the command's script and every flag the command uses."""
    target = block.marker[1]
    file, _, name = target.partition("::")
    path = ROOT / file
    assert path.is_file() and name, f"{block.where}: covered: {target} is not tests/FILE.py::test_name"
    source = path.read_text()
    tests = {n.name for n in ast.walk(ast.parse(source)) if isinstance(n, ast.FunctionDef)}
    assert name in tests, f"{block.where}: {file} has no {name}"
    for command in block.commands():
        # conftest.run_launched starts a script as `lightning run model` does, its launcher options as keywords
        launched = command.startswith(("lightning run model ", "disttrain run ")) and "run_launched(" in source
        for token in shlex.split(command):
            wanted = Path(token).name if token.endswith(".py") else token.split("=")[0]
            if launched and wanted in LAUNCHER_OPTIONS:
                continue
            if token.endswith(".py") or token.startswith("--"):
                assert wanted in source, f"{block.where}: {target} does not run `{command}` ({wanted} is not in it)"


# Words of a skip reason that the visible note must repeat: what the reader needs to run the block.
NOTE_WORDS = ("GPU", "cluster", "fragment", "benchmark")


def note_problem(block: Block) -> Optional[str]:
    reason = block.marker[1]
    if block.note is None and any(w.lower() in reason.lower() for w in NOTE_WORDS):
        return (f"{block.where}: the skip marker's reason ({reason}) is an HTML comment, which a rendered page hides;"
                " put the reason before it as a short italic paragraph, e.g. *Needs a GPU.* or *A fragment:"
                " `trainer` comes from your script.*")
    if block.note is None:  # nothing the reader needs: an install command, output that differs on every machine
        return None
    missing = [w for w in NOTE_WORDS if w.lower() in reason.lower() and w.lower() not in block.note.lower()]
    if missing:
        return f"{block.where}: the note {block.note!r} does not say what its marker says: {', '.join(missing)}"
    return None


def skip_cases() -> list:
    return [pytest.param(block, id=block.where) for block in marked("skip")]


@pytest.mark.parametrize("block", skip_cases())
def test_skipped_blocks_say_why(block):
    """The reader sees why a block is not run (the note), and the test report says it (the skip)."""
    problem = note_problem(block)
    assert problem is None, problem
    pytest.skip(f"{block.where}: {block.marker[1]}")


def test_note_check_finds_a_hidden_reason_and_a_note_that_leaves_the_gpu_out(tmp_path):
    def only(text: str) -> Block:
        return next(b for b in parse(tmp_path / "p.md", text).blocks if b.marker)

    fence = "<!-- docs-test: skip: needs a GPU -->\n```bash\nnvidia-smi\n```\n"
    assert "an HTML comment" in note_problem(only("Run it:\n\n" + fence))
    assert "GPU" in note_problem(only("*Not run here.*\n\n" + fence)).split(":")[-1]
    assert note_problem(only("*Needs a GPU*\n(not run)\n\n" + fence)) is not None  # half a paragraph in italics
    assert note_problem(only("Run it:\n\n*Needs a GPU\nwith 40 GB.*\n\n" + fence)) is None
    # a reason the reader needs nothing for (it installs packages): no note asked for
    assert note_problem(only("Install:\n\n<!-- docs-test: skip: it installs into the active environment -->\n"
                             "```bash\npip install x\n```\n")) is None
    assert note_problem(only("- On a GPU:\n\n  _Needs a GPU._\n\n" + fence)) is None


def test_user_pages_speak_of_what_a_block_needs_not_of_this_test():
    """How the docs are tested is the architecture page's business (and this file's); a user page says what a block
    needs (a GPU, a cluster, your own script), not that a test skips it."""
    tour = DOCS / "architecture.md"
    mentions = [f"{path.relative_to(ROOT)}:{number}" for path in PARSED if path != tour
                for number, line in enumerate(path.read_text().splitlines(), 1) if "docs test" in line.lower()]
    assert not mentions, f"user pages that speak of the docs tests: {mentions}; say what the block needs instead"


def test_the_cron_line_shown_is_the_one_deploy_ships():
    cron = [line for line in (ROOT / "deploy" / "crontab").read_text().splitlines() if not line.startswith("#")]
    assert len(cron) == 1 and cron[0] in (DOCS / "recipes" / "deepfm-daily.md").read_text().splitlines()


# ---- running the pages ---------------------------------------------------------------------------------------

def with_ports(command: str, ports: dict[str, str]) -> str:
    """The command with its own free ports: a fixed port could be taken by another run on this machine."""
    command = re.sub(r"(--master_port|--main-port)([ =])(\d+)",
                     lambda m: f"{m.group(1)}{m.group(2)}{ports.setdefault(m.group(3), str(free_port()))}", command)
    launcher = re.match(r"^(lightning run model|disttrain run) ", command)
    if launcher and "--main-port" not in command:
        command = f"{launcher.group(1)} --main-port {free_port()} {command[launcher.end():]}"
    return command


def printed(expected: str, output: str) -> Optional[str]:
    """None when every line of ``expected`` appears in ``output`` in order (``...`` matches anything), else the
    first line that does not."""
    lines, at = output.splitlines(), 0
    for want in (w.strip() for w in expected.splitlines()):
        if not want or want == "...":
            continue
        parts = [re.escape(p.strip()) for p in want.split("...")]
        pattern = re.compile(".*".join(parts))
        while at < len(lines) and not pattern.search(lines[at]):
            at += 1
        if at == len(lines):
            return want
        at += 1
    return None


def workspace(folder: Path, data: Path) -> Path:
    """A folder that looks like the repository (links to its files) with its own runs/ and a shared data/."""
    work = folder / "work"
    work.mkdir()
    for entry in ROOT.iterdir():
        if entry.name not in NOT_LINKED:
            (work / entry.name).symlink_to(entry)
    (work / "data").symlink_to(data)
    return work


class BlockFailed(Exception):
    pass


# `lightning` as its console script (pyproject's [project.scripts]) runs it
LIGHTNING_COMMAND = ("import sys; from disttrain.cli import lightning_main; sys.argv[0] = 'lightning';"
                     " sys.exit(lightning_main())")


def python_argv(command: str) -> Optional[list[str]]:
    """What ``python`` runs for ``command`` when it is ``python[3] SCRIPT.py ...``, ``python[3] -c "CODE"``,
    ``disttrain ...`` (not its launcher, ``disttrain run``) or ``lightning ... --help``, with no shell syntax beyond a
    trailing comment (inside -c's quoted code, any); None for anything else."""
    code = shlex.split(command) if command.rstrip().endswith(("'", '"')) else []
    if len(code) == 3 and code[0] in ("python", "python3") and code[1] == "-c":
        return code[1:]
    if any(c in command.split(" #")[0] for c in "|&;<>$`*?~(){}"):
        return None
    words = shlex.split(command, comments=True)
    if words and words[0] == "lightning" and "--help" in words:  # the console script disttrain provides
        return ["-c", LIGHTNING_COMMAND, *words[1:]]
    if len(words) > 1 and words[0] in ("python", "python3") and words[1].endswith(".py"):
        return words[1:]
    if len(words) > 1 and words[0] == "disttrain" and words[1] != "run":
        return ["-m", "disttrain.cli", *words[1:]]  # the console script's entry point, disttrain.cli:main
    return None


def run_command(command: str, work: Path, env: dict[str, str], zygote: Optional[Launcher],
                forks: bool = True) -> subprocess.CompletedProcess:
    """One documented command in ``work``. A Python program runs in a fork of a zygote that has imported torch,
    Lightning and the rest once (tests/zygote.py: the same process a fresh interpreter would be), and so do the
    Python processes it starts (``forks=False``: they start fresh); anything else under bash."""
    # Lightning's launchers take MASTER_PORT when it is set: two pages run at once must not pick the same one.
    port = {"MASTER_PORT": str(free_port())}
    argv = python_argv(command) if zygote is not None else None
    if argv is None:
        return subprocess.run(["bash", "-c", command], cwd=work, env={**env, **port}, capture_output=True, text=True,
                              timeout=COMMAND_TIMEOUT)
    return zygote.run_one(argv, env, port, COMMAND_TIMEOUT, cwd=work, forks=forks)


def launched_ranks(block: Block) -> int:
    """How many processes a Python block's ``Trainer``/``Fabric`` runs on: its ``devices=N`` when every one it
    builds says the same N and no ``num_nodes``; 1 otherwise (the block then runs as one plain process)."""
    counts = {int(n) for n in re.findall(r"\bdevices\s*=\s*(\d+)", block.text)}
    return counts.pop() if len(counts) == 1 and "num_nodes" not in block.text else 1


def run_ranks(script: Path, ranks: int, work: Path, env: dict[str, str],
              zygote: Launcher) -> subprocess.CompletedProcess:
    """``torchrun --nproc_per_node RANKS script`` with the ranks forked from zygotes: the example's Trainer or
    Fabric finds torchrun's variables and starts no process of its own. What a ``python example.py`` run saves is a
    second interpreter importing torch, Lightning and the rest (Lightning starts rank 1 with ``sys.executable``);
    README's first such example (the quick start) still runs that way, so the launch a reader's first run takes
    stays checked here. Rank 0's output, then the others', as the combined output."""
    logs = zygote.logs(script.stem, ranks)
    try:
        codes = zygote.run([script.name], env, ranks, free_port(), logs, COMMAND_TIMEOUT, cwd=work)
    except TimeoutError:
        raise subprocess.TimeoutExpired([sys.executable, script.name], COMMAND_TIMEOUT) from None
    output = "".join(log.read_text(errors="replace") for log in logs)
    return subprocess.CompletedProcess([sys.executable, script.name], Launcher.exit_code(codes), output, "")


def first_launch() -> Optional[Block]:
    """README's first example that runs on several processes: the one a reader runs first, as ``python``."""
    readme = PARSED.get(ROOT / "README.md")
    return next((b for b in readme.blocks if b.runs and b.lang in PYTHON and launched_ranks(b) > 1), None) \
        if readme else None


FIRST_LAUNCH = first_launch()


def run_block(block: Block, work: Path, env: dict[str, str],
              zygote: Optional[Launcher] = None) -> tuple[str, list[str]]:
    """Run a block's commands (a Python block as a script); return what it printed and its commands' timings."""
    if block.lang in PYTHON:
        script = work / f"docs_{block.page.stem}_{block.line}.py"
        script.write_text(block.text)
        commands = [f"python {script.name}"]
        ranks = launched_ranks(block)
        if ranks > 1 and zygote is not None and block is not FIRST_LAUNCH:
            start = time.perf_counter()
            proc = run_ranks(script, ranks, work, env, zygote)
            timings = [f"{time.perf_counter() - start:6.1f}s  {block.where}  torchrun --nproc_per_node {ranks} "
                       f"{script.name}"]
            check_exit(block, f"torchrun --nproc_per_node {ranks} {script.name}", proc)
            return proc.stdout + proc.stderr, timings
    else:
        ports: dict[str, str] = {}
        commands = [with_ports(c, ports) for c in block.commands()]
    output, timings = "", []
    for command in commands:
        start = time.perf_counter()
        proc = run_command(command, work, env, zygote, forks=block is not FIRST_LAUNCH)
        timings.append(f"{time.perf_counter() - start:6.1f}s  {block.where}  {command}")
        output += proc.stdout + proc.stderr
        check_exit(block, command, proc)
    return output, timings


def check_exit(block: Block, command: str, proc: subprocess.CompletedProcess) -> None:
    """Raise BlockFailed unless ``command`` failed exactly when the block's marker says it fails."""
    failed = proc.returncode != 0
    if failed != bool(block.marker and block.marker[0] == "fails"):
        outcome = f"exited {proc.returncode}" if failed else "succeeded but the page says it fails"
        raise BlockFailed(f"{block.where}: `{command}` {outcome}:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")


def run_page(path: Path, work: Path, zygote: Optional[Launcher] = None) -> tuple[Optional[str], list[str]]:
    """Every runnable block of the page in order, shown output checked: (what failed or None, timings)."""
    env, last_output, timings = child_env(), "", []
    try:
        for block in PARSED[path].blocks:
            if block.runs:
                last_output, spent = run_block(block, work, env, zygote)
                timings += spent
            elif block.marker and block.marker[0] == "output":  # parse() saw to it that a run block comes before
                missing = printed(block.text, last_output)
                if missing is not None:
                    raise BlockFailed(f"{block.where}: the block above did not print {missing!r}:\n{last_output}")
    except (BlockFailed, subprocess.TimeoutExpired) as e:
        return str(e), timings
    return None, timings


def test_commands_ports_and_shown_output_are_read_as_documented():
    block = Block(Path("x.md"), 1, "bash", "# a comment\nlightning run model s.py --devices 2 \\\n    --steps 4\n\n"
                                            "torchrun --master_port 29500 a.py\ntorchrun --master_port=29500 b.py\n")
    first, second, third = block.commands()
    assert first == "lightning run model s.py --devices 2 --steps 4"
    assert re.fullmatch(r"lightning run model --main-port \d+ s.py --devices 2 --steps 4", with_ports(first, {}))
    ports: dict[str, str] = {}
    a, b = with_ports(second, ports), with_ports(third, ports)
    assert a.split()[2] == b.split("=")[1].split()[0] == ports["29500"] != "29500"  # one free port for both nodes
    assert printed("model: llama ...\n...\nrecommendation: x", "noise\nmodel: llama, 10B\nrow\nrecommendation: x") is None
    assert printed("second\nfirst", "first\nsecond") == "first"  # in order
    # what runs in a fork of the zygote: python -c (its quoted code may hold any character), lightning's help
    assert python_argv('python -c "import torch; print(torch.cuda.is_available())"') == [
        "-c", "import torch; print(torch.cuda.is_available())"]
    assert python_argv('python -c "print(1)" > out') is None and python_argv("python -c 'print(1)' | wc") is None
    assert python_argv("lightning run model --help") == ["-c", LIGHTNING_COMMAND, "run", "model", "--help"]
    assert python_argv("lightning run model s.py --devices 2") is None  # a launch: its ranks are the launcher's


def runnable_pages() -> list[Path]:
    return [path for path, page in PARSED.items() if any(b.runs for b in page.blocks)]


@pytest.fixture(scope="session")
def page_runs(request, tmp_path_factory) -> dict[Path, tuple[Optional[str], list[str]]]:
    """Runs the selected pages, two at a time: most of a command's time is one process importing torch and
    Lightning, which leaves the second core idle. Each page gets its own folder; data/ is shared."""
    wanted = [item.callspec.params["path"] for item in request.session.items
              if getattr(item, "originalname", "") == "test_documented_commands_run"]
    data = tmp_path_factory.mktemp("docs-data")
    works = {path: workspace(tmp_path_factory.mktemp("docs-page"), data) for path in wanted}
    longest_first = sorted(wanted, key=lambda p: -sum(len(b.commands()) if b.lang in SHELL else 2
                                                        for b in PARSED[p].blocks if b.runs))
    zygotes = shared_launcher(child_env())  # the session's, for both threads
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {path: pool.submit(run_page, path, works[path], zygotes) for path in longest_first}
    return {path: future.result() for path, future in futures.items()}


@pytest.mark.slow
@pytest.mark.timeout(3600)  # the first page's test waits for all of them (page_runs)
@pytest.mark.parametrize("path", runnable_pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_documented_commands_run(path, page_runs):
    """Every runnable block of the page ran as the page says (see run_page)."""
    failure, timings = page_runs[path]
    print("\n" + "\n".join(timings))
    if failure:
        pytest.fail(failure)
