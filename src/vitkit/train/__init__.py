"""Training: recipes (typed configs), the resumable distributed loop, evaluation and prediction. The names
load on first use (lazy_loader): the recipes need no torch, the loop does."""

import lazy_loader

__getattr__, __dir__, __all__ = lazy_loader.attach(
    __name__,
    submod_attrs={
        "evaluate": ["EvalResult", "confusion_png", "evaluate"],
        "loop": ["RunResult", "TrainingDiverged", "train"],
        "overrides": ["apply_overrides"],
        "recipes": ["RECIPES", "get_recipe"],
        "settings": ["DataConfig", "OptimConfig", "TrainConfig"],
        "stopping": ["TrainingStopped"],
    },
)
