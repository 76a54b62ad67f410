"""Models by name from the Hugging Face hub, through `huggingface_hub` and its cache.

Two kinds of name:
- "hf-hub:ORG/REPO" (optionally "@REVISION"): any repository holding a timm or transformers ViT folder,
  e.g. "hf-hub:google/vit-base-patch16-224" or "hf-hub:timm/vit_base_patch16_224.augreg_in21k".
- timm's names, "ARCH.TAG" such as "vit_base_patch16_224.augreg2_in21k_ft_in1k": timm publishes them as
  the repository "timm/ARCH.TAG". A bare "ARCH" takes timm's default tag, which needs timm installed.

Files land in the hub cache (HF_HUB_CACHE, or HF_HOME/hub, read when called) and are not fetched again.
With HF_HUB_OFFLINE=1 nothing is downloaded: a name that is not cached is an error that says so.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from .checkpoint import CheckpointError

PREFIX = "hf-hub:"
CONFIG_FILES = ("config.json", "preprocessor_config.json")  # the second is optional
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
_TIMM_NAME = re.compile(r"[a-z][a-z0-9_]*(\.[a-z0-9_]+)?")
_TRUE = ("1", "true", "yes", "on")
_FILE_SUFFIXES = (".npz", ".safetensors", ".pth", ".pt", ".bin", ".ckpt", ".json")


def is_hub_name(text: str) -> bool:
    """True for "hf-hub:..." and for timm-style names ("vit_base_patch16_224[.tag]"): no path separators,
    no checkpoint file extension."""
    if text.startswith(PREFIX):
        return True
    return _TIMM_NAME.fullmatch(text) is not None and Path(text).suffix.lower() not in _FILE_SUFFIXES


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE


def cache_dir() -> Path:
    """The hub cache, from the environment at call time (huggingface_hub reads it once, at import)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]) / "hub"
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def repo_for(name: str) -> tuple[str, str | None]:
    """(repository id, revision) for a hub name."""
    if name.startswith(PREFIX):
        repo = name[len(PREFIX):]
        repo, _, revision = repo.partition("@")
        if repo.count("/") != 1 or not all(repo.split("/")):
            raise CheckpointError(f"{name}: expected 'hf-hub:ORG/REPO' (optionally '@REVISION')")
        return repo, revision or None
    if "." in name:
        return f"timm/{name}", None
    try:
        from timm.models import get_pretrained_cfg
    except ImportError:
        raise CheckpointError(f"{name}: give timm's pretrained tag (e.g. '{name}.augreg2_in21k_ft_in1k'), or "
                              "install timm to use its default") from None
    pcfg = get_pretrained_cfg(name)
    if pcfg is None or not pcfg.hf_hub_id:
        raise CheckpointError(f"{name}: timm knows no pretrained weights on the hub under this name")
    return pcfg.hf_hub_id, None


def display_name(name: str) -> str:
    """The name as it should appear in the model's config: timm's "ARCH.TAG", or the hub repository."""
    repo, _ = repo_for(name)
    return repo[len("timm/"):] if repo.startswith("timm/") else repo


def fetch(name: str) -> Path:
    """The local folder (a hub-cache snapshot) with the config and weights of `name`, downloading what is
    missing unless HF_HUB_OFFLINE is set."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import (
        EntryNotFoundError,
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    repo, revision = repo_for(name)
    local_only = offline()
    cache = cache_dir()

    def get(filename: str) -> Path | None:
        try:
            return Path(hf_hub_download(repo, filename, revision=revision, cache_dir=str(cache),
                                        local_files_only=local_only))
        except LocalEntryNotFoundError:  # before its base class EntryNotFoundError: not cached, not fetched
            if local_only:
                return None
            raise CheckpointError(f"{name}: cannot download {filename} from the hub repository {repo} and it is "
                                  f"not in the cache {cache} (no network?)") from None
        except EntryNotFoundError:  # the repository has no such file (checked online)
            return None
        except GatedRepoError:
            raise CheckpointError(f"{name}: the repository {repo} is gated; accept its terms on "
                                  "huggingface.co and log in (huggingface-cli login)") from None
        except RepositoryNotFoundError:
            raise CheckpointError(f"{name}: no repository {repo} on the Hugging Face hub") from None
        except RevisionNotFoundError:
            raise CheckpointError(f"{name}: the repository {repo} has no revision {revision!r}") from None

    def not_cached(what: str) -> CheckpointError:
        return CheckpointError(
            f"{name}: {what} of {repo} is not in the Hugging Face cache {cache}, and HF_HUB_OFFLINE=1 forbids "
            "downloading it; run once with network access (unset HF_HUB_OFFLINE) or point HF_HUB_CACHE at a "
            "cache that holds it")

    config = get("config.json")
    if config is None:
        if local_only:
            raise not_cached("config.json")
        raise CheckpointError(f"{name}: the repository {repo} has no config.json, so it is not a timm or "
                              "transformers model folder")
    get("preprocessor_config.json")  # optional: transformers' preprocessing, next to config.json
    for weights in WEIGHT_FILES:
        path = get(weights)
        if path is not None:
            if path.parent != config.parent:
                raise CheckpointError(f"{name}: config and weights resolved to different snapshots "
                                      f"({config.parent}, {path.parent})")
            return config.parent
    if local_only:
        raise not_cached(" or ".join(WEIGHT_FILES))
    raise CheckpointError(f"{name}: the repository {repo} has none of {', '.join(WEIGHT_FILES)}")
