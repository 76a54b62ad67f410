"""Training: recipes (typed configs), the resumable distributed loop, evaluation and prediction."""

from .evaluate import EvalResult, confusion_png, evaluate
from .loop import RunResult, TrainingDiverged, train
from .recipes import RECIPES, DataConfig, OptimConfig, TrainConfig, apply_overrides, get_recipe
from .stopping import TrainingStopped

__all__ = [
    "RECIPES",
    "DataConfig",
    "EvalResult",
    "OptimConfig",
    "RunResult",
    "TrainConfig",
    "TrainingDiverged",
    "TrainingStopped",
    "apply_overrides",
    "confusion_png",
    "evaluate",
    "get_recipe",
    "train",
]
