"""Sphinx configuration of the API reference: ``make docs`` builds it into build/api (``tests/test_api_reference.py``
builds it with warnings as errors).

The pages are generated from the docstrings (autodoc). Two things come from the code rather than from the pages:
the option dataclasses' entries (``name: text`` in the class docstring) become a table, read by the same parser as
the option tables of docs/strategies.md (docs/options.py), and the command-line page shows what ``disttrain COMMAND
--help`` prints, for every command that ``disttrain --help`` lists (a command missing from the page is a warning).
A strategy class shows its signature and, from its ``__init__`` docstring (generated from the same dataclass by
tools/strategy_signatures.py), what each option does.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import re
import sys
from pathlib import Path

from docutils import nodes
from docutils.parsers.rst import Directive
from sphinx.util import logging

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "docs")]
os.environ.setdefault("COLUMNS", "100")  # argparse wraps --help to the terminal's width

import options  # noqa: E402  (docs/options.py)

project = "disttrain"
author = "the disttrain authors"
copyright = "the disttrain authors"
release = version = __import__("disttrain").__version__

extensions = ["sphinx.ext.autodoc", "sphinx.ext.napoleon"]
napoleon_google_docstring = True
napoleon_numpy_docstring = False
autodoc_member_order = "bysource"
# A strategy class's __init__ docstring describes each of its options (generated from the options dataclass)
autoclass_content = "both"
autodoc_typehints = "signature"
autodoc_inherit_docstrings = False  # Lightning's own docstrings belong to Lightning's reference
autodoc_default_options = {"members": True, "show-inheritance": True}
html_theme = "alabaster"
html_title = f"disttrain {release} API reference"
exclude_patterns = ["_build"]

log = logging.getLogger(__name__)


def option_table(app, what, name, obj, opts, lines):
    """An option dataclass's docstring: its first paragraph, one row per field it declares (name, default, what it
    does), then what else the docstring says."""
    if what != "class" or not dataclasses.is_dataclass(obj) or obj.__name__ not in options.option_classes():
        return
    cleaned = [line.rstrip() for line in lines]
    intro = cleaned[:cleaned.index("")] if "" in cleaned else cleaned[:1]
    docs = options.field_docs(obj)
    table = ["", ".. list-table::", "   :header-rows: 1", "   :widths: 20 15 65", "",
             "   * - option", "     - default", "     - what it does"]
    for field in options.own_fields(obj):
        table += [f"   * - ``{field.name}``", f"     - ``{options.default_text(field)}``",
                  f"     - {docs.get(field.name, options.MISSING)}"]
    names = "|".join(re.escape(f.name) for f in dataclasses.fields(obj))
    entries: list[str] = []
    for line in cleaned[len(intro):]:
        if line and not line[0].isspace():
            entries.append(line.strip())
        elif line.strip() and entries:
            entries[-1] += " " + line.strip()
    rest: list[str] = []  # what is not an option's entry: consecutive lines are one paragraph
    for before, entry in zip([None, *entries], entries):
        if re.match(rf"(?:{names})(?:, (?:{names}))*: ", entry):
            continue
        if rest and before is not None and not re.match(rf"(?:{names})(?:, (?:{names}))*: ", before):
            rest[-1] += " " + entry
        else:
            rest.append(entry)
    bases = [b.__name__ for b in obj.__mro__[1:] if dataclasses.is_dataclass(b)]
    if bases:
        base = next(b for b in obj.__mro__[1:] if dataclasses.is_dataclass(b))
        rest.insert(0, f"Every option of :class:`~{base.__module__}.{base.__name__}` applies too.")
    lines[:] = intro + table + [""] + [line for e in rest for line in (e, "")]


def help_text(words: list[str]) -> str:
    from disttrain import cli

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            code = cli.main([*words, "--help"]) if words[:2] != ["lightning", "run"] else \
                cli.lightning_main(["run", "model", "--help"])
        except SystemExit as e:
            code = e.code
    if code not in (0, None):
        raise RuntimeError(f"`{' '.join(words)} --help` exited {code}:\n{out.getvalue()}")
    return out.getvalue().rstrip()


def listed_commands() -> list[str]:
    """The commands ``disttrain --help`` lists, e.g. ``plan`` and ``recsys daily``."""
    from disttrain import cli

    commands = []
    for line in cli.USAGE.splitlines():
        if not re.match(r"^  \S", line):
            continue
        head = re.split(r"\s{2,}", line.strip())[0].split()
        words = [w for w in head[:next((i for i, w in enumerate(head) if not re.fullmatch(r"[a-z][a-z-]*", w)),
                                       len(head))]]
        commands.append(" ".join(words))
    return commands


class CommandHelp(Directive):
    """``.. command-help:: disttrain plan``: what the command's ``--help`` prints, as a literal block."""

    required_arguments = 1
    final_argument_whitespace = True

    def run(self):
        words = self.arguments[0].split()
        env = self.state.document.settings.env
        env.domaindata.setdefault("disttrain_cli", {})[" ".join(words[1:])] = env.docname
        shown = " ".join(words) + " --help" if words[0] == "disttrain" else "lightning run model --help"
        text = help_text(words[1:] if words[0] == "disttrain" else words)
        return [nodes.literal_block(text, f"$ {shown}\n{text}")]


class OptionClasses(Directive):
    """``.. option-classes::``: every option dataclass of a registered strategy (and their bases), in the registry's
    order, so a new strategy's options appear without editing the page."""

    def run(self):
        text = []
        for cls in options.option_classes().values():
            text += [f".. autoclass:: {cls.__module__}.{cls.__name__}", ""]
        self.state_machine.insert_input(text, "<option-classes>")
        return []


def every_command_documented(app, env):
    documented = env.domaindata.get("disttrain_cli", {})
    for command in listed_commands():
        if command not in documented:
            log.warning(f"`disttrain {command}` is listed by `disttrain --help` but has no `.. command-help::` on"
                        " the command-line page")


def setup(app):
    app.connect("autodoc-process-docstring", option_table)
    app.add_directive("command-help", CommandHelp)
    app.add_directive("option-classes", OptionClasses)
    app.connect("env-check-consistency", every_command_documented)
    return {"parallel_read_safe": False}
