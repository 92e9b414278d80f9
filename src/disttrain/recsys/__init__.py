"""DeepFM on torchrec, its data, metrics and the daily retraining job (``disttrain recsys make-data|daily``)."""

from disttrain.parallel.families.deepfm import DeepFMNet, fm_interaction
from disttrain.recsys.model import DeepFM

__all__ = ["DeepFM", "DeepFMNet", "fm_interaction"]
