"""Click-prediction metrics through torchmetrics (torchrec's RecMetrics fail to compute with torchmetrics 1.9):
AUC, log loss, normalised entropy (log loss over the entropy of the base click rate) and calibration
(predicted clicks over actual clicks). States are summed over ranks by torchmetrics when a process group runs."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torchmetrics import Metric
from torchmetrics.classification import BinaryAUROC


class _LogLossSums(Metric):
    full_state_update = False

    def __init__(self) -> None:
        super().__init__()
        for name in ("loss", "labels", "predicted", "count"):
            self.add_state(name, default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, logits: torch.Tensor, labels: torch.Tensor) -> None:
        logits, labels = logits.detach().double(), labels.detach().double()
        self.loss += F.binary_cross_entropy_with_logits(logits, labels, reduction="sum")
        self.labels += labels.sum()
        self.predicted += torch.sigmoid(logits).sum()
        self.count += labels.numel()

    def compute(self) -> dict[str, float]:
        count = max(self.count.item(), 1.0)
        logloss = self.loss.item() / count
        rate = min(max(self.labels.item() / count, 1e-12), 1 - 1e-12)
        entropy = -(rate * math.log(rate) + (1 - rate) * math.log(1 - rate))
        calibration = self.predicted.item() / self.labels.item() if self.labels.item() > 0 else float("nan")
        return {"logloss": logloss, "ne": logloss / entropy, "calibration": calibration, "rows": int(count)}


class ClickMetrics:
    """``update(logits, labels)`` per batch, then ``compute()`` -> ``{"auc", "logloss", "ne", "calibration",
    "rows"}``. Exact AUC by default; ``auc_thresholds=N`` bins predictions (constant memory for huge days)."""

    def __init__(self, auc_thresholds: int | None = None, device: torch.device | str = "cpu") -> None:
        self.auc = BinaryAUROC(thresholds=auc_thresholds).to(device)
        self.sums = _LogLossSums().to(device)

    def update(self, logits: torch.Tensor, labels: torch.Tensor) -> None:
        self.auc.update(torch.sigmoid(logits.detach().float()), labels.detach().long())
        self.sums.update(logits, labels)

    def compute(self) -> dict[str, float]:
        return {"auc": float(self.auc.compute()), **self.sums.compute()}
