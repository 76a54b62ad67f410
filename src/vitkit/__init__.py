"""vitkit: the Vision Transformer of "An Image is Worth 16x16 Words" (Dosovitskiy et al., ICLR 2021)."""

from .allocator import retain_freed_memory
from .checkpoint import save
from .config import ViTConfig, get_config, list_models
from .inference import optimize
from .loading import load  # every format; vitkit.checkpoint.load_vitkit reads the native one
from .model import VisionTransformer, count_flops, count_parameters, create_model
from .posemb import resample_pos_embed

__version__ = "0.1.0"

__all__ = [
    "ViTConfig",
    "VisionTransformer",
    "count_flops",
    "count_parameters",
    "create_model",
    "get_config",
    "list_models",
    "load",
    "optimize",
    "resample_pos_embed",
    "retain_freed_memory",
    "save",
]
