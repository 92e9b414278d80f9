"""DeepFM on torchrec, its data, metrics and the daily retraining job (``disttrain recsys make-data|daily``)."""

from disttrain.recsys.model import DeepFM, DeepFMNet, fm_interaction

__all__ = ["DeepFM", "DeepFMNet", "fm_interaction"]
