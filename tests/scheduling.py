"""How ``make test`` spreads the suite over its pytest-xdist workers (``--dist loadfile --no-loadscope-reorder``).

- One work unit per test file, except the files that share conftest.py's session-scoped launches (``trainer_fsdp``,
  ``trainer_zero3``, ...): they are one unit, so each of those launches runs once per run, not once per worker that
  happens to get one of its files.
- Units go out longest first, by the seconds ``tests/durations.json`` records for each file; a file it does not
  know counts as the longest, so a new file never ends the run alone. (xdist's own order, most tests first, sent
  the 4-test, 85-second GPU-check dry run last, to run while the other worker had nothing left to do.)
- ``make durations`` rewrites ``tests/durations.json`` from a whole run (each file's seconds, fixtures included).
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pytest

DURATIONS = Path(__file__).with_name("durations.json")
# The files using conftest.py's session-scoped launches (a fixture name as argument of their tests).
SHARED_LAUNCHES = ("test_distributed.py", "test_user_models.py", "test_zero3.py", "test_zero3_checkpoints.py")


def unit_of(file_name: str) -> str:
    return "shared-launches" if file_name in SHARED_LAUNCHES else file_name


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--record-durations", metavar="PATH", default=None,
                     help="write each test file's seconds (setup, call and teardown) to PATH as JSON")


@pytest.hookimpl(optionalhook=True)  # an xdist hook: absent under -p no:xdist
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """Under ``--dist loadfile``: xdist's scheduling of whole scopes, each unit (above) one scope."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ByUnit(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return unit_of(Path(nodeid.split("::")[0]).name)

    return ByUnit(config, log)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Units longest first; a unit's tests stay in their order."""
    seconds = json.loads(DURATIONS.read_text()) if DURATIONS.is_file() else {}
    unknown = max(seconds.values(), default=0.0) + 1.0
    weight: dict[str, float] = defaultdict(float)
    for file_name in {item.path.name for item in items}:
        weight[unit_of(file_name)] += seconds.get(file_name, unknown)
    order = {id(item): (-weight[unit_of(item.path.name)], unit_of(item.path.name), i) for i, item in enumerate(items)}
    items.sort(key=lambda item: order[id(item)])


_seconds: dict[str, float] = defaultdict(float)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _seconds[Path(report.nodeid.split("::")[0]).name] += report.duration


def pytest_sessionfinish(session: pytest.Session) -> None:
    path = session.config.getoption("record_durations")
    if path and not hasattr(session.config, "workerinput"):  # the controller sees every worker's reports
        Path(path).write_text(json.dumps({k: round(v, 1) for k, v in sorted(_seconds.items())}, indent=1) + "\n")
