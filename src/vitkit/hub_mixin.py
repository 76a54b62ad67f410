"""The Hugging Face Hub's conventions on VisionTransformer: `from_pretrained`, `save_pretrained` and
`push_to_hub`, through huggingface_hub's own `ModelHubMixin` (the download, the upload and the repository are
theirs). The folder is vitkit's own (vitkit.folder_format: config.json and model.safetensors, as
`vitkit.save` writes it, so `vitkit.load` reads it and timm loads its model.safetensors) with a model card,
README.md, beside it: the config, the preprocessing, the classes and, for a model from a training run, the
run's record.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from huggingface_hub import ModelCard, ModelCardData, ModelHubMixin

from .folder_format import load_folder, preprocessing, save_model

REPO_URL = "https://github.com/vitkit/vitkit"
PAPER_URL = "https://arxiv.org/abs/2010.11929"
TAGS = ["vision-transformer", "image-classification"]


class HubMixin(ModelHubMixin, library_name="vitkit", tags=TAGS, pipeline_tag="image-classification",
               repo_url=REPO_URL):
    """Hub methods for VisionTransformer (module docstring); `model.class_names` and `model.train_record`,
    which `vitkit.load` sets, go into the folder and the card."""

    def _save_pretrained(self, save_directory: Path) -> None:
        """vitkit's folder (what vitkit.save writes), with the model's class names and training record."""
        record = getattr(self, "train_record", None)
        save_model(self, type(self), save_directory, getattr(self, "class_names", None),
                   {"train": record} if record else None, verb="save_pretrained")

    @classmethod
    def _from_pretrained(cls, *, model_id: str, revision: str | None, cache_dir: str | Path | None,
                         force_download: bool, local_files_only: bool, token: str | bool | None,
                         map_location: str = "cpu", proxies: Any = None, resume_download: Any = None,
                         **model_kwargs: Any):
        """The model of a vitkit folder (what save_pretrained writes): a local one, or a Hub repository
        fetched by huggingface_hub's snapshot_download (its cache, its offline mode). In eval mode, as
        vitkit.load gives it. (vitkit.load("hf-hub:ORG/REPO") reads timm's and transformers' layouts too.)
        `proxies` and `resume_download` are what older huggingface_hub versions pass along; not used."""
        if model_kwargs:
            raise TypeError(f"from_pretrained takes no model arguments ({', '.join(model_kwargs)}): the "
                            "config comes from the folder; change it afterwards (model.reset_classifier(n))")
        folder = model_id
        if not os.path.isdir(model_id):
            from huggingface_hub import snapshot_download

            folder = snapshot_download(repo_id=model_id, revision=revision, cache_dir=cache_dir,
                                       force_download=force_download, local_files_only=local_files_only,
                                       token=token)
        return load_folder(cls, folder).to(map_location).eval()

    def generate_model_card(self, *args, **kwargs) -> ModelCard:
        """README.md: the Hub's metadata header, then what a reader needs to use the model."""
        data = ModelCardData(library_name="vitkit", tags=list(TAGS), pipeline_tag="image-classification")
        return ModelCard(f"---\n{data.to_yaml()}\n---\n\n" + card_text(self))


def card_text(model) -> str:
    """The model card's body for `model` (a VisionTransformer): use, architecture, preprocessing, classes, and
    its training record when it has one."""
    cfg = model.cfg
    params = sum(p.numel() for p in model.parameters())
    lines = [f"# {cfg.name or 'Vision Transformer'}", "",
             f"A Vision Transformer ([Dosovitskiy et al., ICLR 2021]({PAPER_URL})) saved by "
             f"[vitkit]({REPO_URL}).", "",
             "## Use", "", "```python", "import vitkit", "",
             'model = vitkit.VisionTransformer.from_pretrained("REPO_OR_FOLDER")  # or vitkit.load(folder)',
             "```", "", "## Architecture", "", "| setting | value |", "|---|---|",
             f"| parameters | {params:,} |"]
    for key in ("image_size", "patch_size", "in_chans", "num_classes", "dim", "depth", "num_heads",
                "mlp_dim", "pool", "class_token", "pos_embed", "representation_size", "hybrid_layers",
                "dynamic_img_size"):
        lines.append(f"| {key} | {getattr(cfg, key)} |")
    lines += ["", "## Preprocessing", "", "| step | value |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in preprocessing(cfg).items()]
    names = getattr(model, "class_names", None)
    if names:
        shown = ", ".join(names[:20]) + (f", ... ({len(names)} in all)" if len(names) > 20 else "")
        lines += ["", "## Classes", "", shown]
    record = getattr(model, "train_record", None)
    if record:
        lines += ["", "## Training", "", "| measure | value |", "|---|---|"]
        split = record.get("split", "?")
        for key in ("step", "seconds", "top1", "top5", "loss"):
            if key in record:
                label = f"{key} on the {split} split" if key in ("top1", "top5", "loss") else key
                lines.append(f"| {label} | {record[key]} |")
        test = record.get("test")
        if isinstance(test, dict):
            lines += [f"| test top1 ({test.get('count', '?')} images) | {test.get('top1')} |"]
    return "\n".join(lines) + "\n"
