"""The ViT trainer: a timm VisionTransformer classifier (up to the ~2B config), ImageFolder data with timm
augmentation, the scikit-learn digits demo tree, and an export timm loads."""

from disttrain.vision.config import TrainConfig, build_vit, count_parameters, read_yaml, train_config
from disttrain.vision.data import DataConfig, ImageFolderData, data_config, write_digits
from disttrain.vision.defaults import default_config, default_strategy
from disttrain.vision.export import export_timm
from disttrain.vision.module import ViTClassifier

__all__ = ["DataConfig", "ImageFolderData", "TrainConfig", "ViTClassifier", "build_vit", "count_parameters",
           "data_config", "default_config", "default_strategy", "export_timm", "read_yaml", "train_config",
           "write_digits"]
