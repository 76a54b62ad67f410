"""Looking inside a ViT as the paper does: attention rollout (Fig. 6), patch-embedding filters, position-
embedding similarity and mean attention distance (Fig. 7), few-shot linear evaluation and a linear probe.

Each analysis is a pure function on tensors; `figures` draws them; `vitkit analyze ...`, `vitkit fewshot`
and `vitkit probe` run them on any checkpoint vitkit loads.
"""

from .distance import attention_distance, mean_attention_distance, patch_distances
from .features import Features, compute_features, extract_features
from .fewshot import FewShotResult, fewshot_eval, fit_lsr
from .filters import FilterComponents, filter_principal_components
from .posemb_similarity import position_similarity
from .probe import ProbeResult, linear_probe
from .rollout import attention_rollout, layer_attention, rollout_matrix

__all__ = [
    "FewShotResult",
    "Features",
    "FilterComponents",
    "ProbeResult",
    "attention_distance",
    "attention_rollout",
    "compute_features",
    "extract_features",
    "fewshot_eval",
    "filter_principal_components",
    "fit_lsr",
    "layer_attention",
    "linear_probe",
    "mean_attention_distance",
    "patch_distances",
    "position_similarity",
    "rollout_matrix",
]
