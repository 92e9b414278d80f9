"""The ViT trainer: a timm VisionTransformer classifier (up to the ~2B config), ImageFolder data with timm
augmentation, the digits demo tree, fine-tuning from a timm checkpoint, and an export timm loads."""

from disttrain.vision.config import TrainConfig, build_vit, count_parameters, read_yaml, train_config
from disttrain.vision.data import DataConfig, ImageFolderData, SkippingSampler, data_config, write_digits
from disttrain.vision.defaults import default_config, default_strategy
from disttrain.vision.export import export_timm
from disttrain.vision.module import ViTClassifier
from disttrain.vision.pretrained import TimmCheckpoint, load_timm_checkpoint, timm_checkpoint

__all__ = ["DataConfig", "ImageFolderData", "SkippingSampler", "TimmCheckpoint", "TrainConfig", "ViTClassifier",
           "build_vit", "count_parameters", "data_config", "default_config", "default_strategy", "export_timm",
           "load_timm_checkpoint", "read_yaml", "timm_checkpoint", "train_config", "write_digits"]
