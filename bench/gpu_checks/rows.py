"""The report's row: torch-free, so the orchestrating process can write rows without importing torch."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Optional

STATUSES = ("pass", "fail", "skipped", "dry")


@dataclass
class Row:
    """One line of the report.

    ``kind`` is "numerics" (judged in a dry run too: losses and counts must hold on any device) or "device" (a
    figure of the device itself, judged on a GPU only; a CPU dry run reports it with status "dry"). ``ok`` None
    means skipped, and ``reason`` says why; for a judged row it says what fell short.
    """

    check: str
    item: str
    figure: str
    target: str
    ok: Optional[bool]
    reason: str = ""
    kind: str = "numerics"
    value: Optional[float] = None
    details: dict = field(default_factory=dict)
    status: str = ""
    seconds: Optional[float] = None

    def judged(self, dry: bool) -> "Row":
        if self.ok is None:
            self.status = "skipped"
        elif dry and self.kind == "device":
            self.status = "dry"
        else:
            self.status = "pass" if self.ok else "fail"
        return self

    def to_json(self) -> dict:
        return asdict(self)


def skipped(check: str, item: str, target: str, reason: str) -> Row:
    return Row(check, item, "-", target, None, reason)
