"""The API reference (docs/api, Sphinx autodoc) builds from the docstrings with warnings as errors, so a docstring
that does not render, a module that no longer imports or a command missing from the command-line page fails the
suite; and its two generated parts (option tables, command help) follow the code."""

from __future__ import annotations

import dataclasses
import html
import importlib.util
import inspect
import re

import pytest

from conftest import ROOT, run_python

API = ROOT / "docs" / "api"


def conf():
    spec = importlib.util.spec_from_file_location("api_conf", API / "conf.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_command_line_page_has_every_command_disttrain_lists():
    shown = set(re.findall(r"^\.\. command-help:: disttrain ?(.*)$", (API / "cli.rst").read_text(), re.M))
    listed = conf().listed_commands()
    assert {"plan", "recsys daily", "report"} <= set(listed), listed  # the listing is read as meant
    assert set(listed) <= shown, f"add `.. command-help:: disttrain X` to docs/api/cli.rst for: {set(listed) - shown}"


def test_an_option_dataclass_renders_as_a_table_of_its_own_fields():
    from disttrain.parallel.engines.megatron import MegatronOptions

    lines = inspect.cleandoc(MegatronOptions.__doc__ or "").splitlines()  # as autodoc hands it over
    conf().option_table(None, "class", "MegatronOptions", MegatronOptions, None, lines)
    text = "\n".join(lines)
    own = [f.name for f in dataclasses.fields(MegatronOptions) if f.name in MegatronOptions.__annotations__]
    assert all(f"* - ``{name}``" in text for name in own)
    assert "* - ``cpu_offload``" not in text and "FSDPOptions` applies too" in text  # inherited: named, not repeated
    assert "(no docstring entry)" not in text
    assert "Data parallel is what is left" in text  # the docstring's text after the entries is kept


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_api_reference_builds_without_warnings(tmp_path):
    """``make docs``: Sphinx with -W (every warning an error), from scratch, as ``python -m sphinx`` in a fork of the
    pre-imported zygote (tests/zygote.py: the process a fresh interpreter would be, torch and Lightning imported
    once; a module that does not import fails autodoc there as anywhere)."""
    proc = run_python("-m", "sphinx", "-W", "--keep-going", "-E", "-q", "-b", "html", str(API), str(tmp_path / "html"),
                      timeout=600)
    warnings = [line for line in proc.stderr.splitlines() if "WARNING" in line or "ERROR" in line]
    assert proc.returncode == 0, "\n".join(warnings) or proc.stderr[-3000:]
    pages = {p.stem for p in (tmp_path / "html").glob("*.html")}
    assert {"index", "strategies", "fabric", "options", "callbacks", "checkpoint", "nlp", "vision", "recsys",
            "cli"} <= pages, pages
    options = (tmp_path / "html" / "options.html").read_text()
    assert "FSDPOptions" in options and "hybrid_shard" in options
    # a strategy class: every option in its signature, and what it does (its generated __init__ docstring)
    strategies = html.unescape(re.sub(r"<[^>]+>", "", (tmp_path / "html" / "strategies.html").read_text()))
    assert "tensor_parallel_size: int = 1" in strategies, "MegatronStrategy's signature lacks its options"
    assert "tensor_parallel_size – ranks that split each block’s heads and MLP" in strategies
