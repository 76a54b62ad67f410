"""Models by name from the Hugging Face hub, through `huggingface_hub` and its cache.

Two kinds of name:
- "hf-hub:ORG/REPO" (optionally "@REVISION"): any repository holding a timm or transformers ViT folder,
  e.g. "hf-hub:google/vit-base-patch16-224" or "hf-hub:timm/vit_base_patch16_224.augreg_in21k".
- timm's names, "ARCH.TAG" such as "vit_base_patch16_224.augreg2_in21k_ft_in1k": timm publishes them as
  the repository "timm/ARCH.TAG". A bare "ARCH" takes timm's default tag, which needs timm installed.

Files land in the hub cache (HF_HUB_CACHE, or HF_HOME/hub, read when called) and are not fetched again.
With HF_HUB_OFFLINE=1 nothing is downloaded: a name that is not cached is an error that says so. Without
network a fully cached model loads too: optional files the cache lacks count as absent, and where the hub's
host does not even resolve the cache is read at once, without huggingface_hub's retries.
"""

from __future__ import annotations

import difflib
import os
import re
import socket
from pathlib import Path

from .checkpoint import CheckpointError
from .convert.detect import SHARD_INDEXES, WEIGHT_FILES, read_json, shard_names

PREFIX = "hf-hub:"
_TIMM_NAME = re.compile(r"[a-z][a-z0-9_]*(\.[a-z0-9_]+)?")
_TRUE = ("1", "true", "yes", "on")
_FILE_SUFFIXES = (".npz", ".safetensors", ".pth", ".pt", ".bin", ".ckpt", ".json")


def is_hub_name(text: str) -> bool:
    """True for "hf-hub:..." and for timm-style names ("vit_base_patch16_224[.tag]"): no path separators,
    no checkpoint file extension (nor a near miss of one)."""
    if text.startswith(PREFIX):
        return True
    return _TIMM_NAME.fullmatch(text) is not None and not looks_like_a_file(text)


def looks_like_a_file(text: str) -> bool:
    """Whether a name ends in a checkpoint file's extension or a near miss of one ("model.safetensor",
    "vit.pht"): such a name means a local file, and a missing one is reported as such, not sent to the hub.
    (No timm tag is that close: the nearest, beit3's ".pt", is a file extension itself.)"""
    suffix = Path(text).suffix.lower().lstrip(".")
    if not suffix:
        return False
    for ext in (s.lstrip(".") for s in _FILE_SUFFIXES):
        if suffix.startswith(ext) or (len(suffix) >= 2 and ext.startswith(suffix)):
            return True
    return bool(difflib.get_close_matches(suffix, [s.lstrip(".") for s in _FILE_SUFFIXES], n=1, cutoff=0.75))


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE


_PROXY_VARIABLES = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")


def hub_resolves() -> bool:
    """Whether the hub's host name resolves (or a proxy, which resolves it, is set). Without network a
    download would only retry, with warnings, for about 25 s before failing: a host that does not resolve
    takes the cache alone at once."""
    if any(os.environ.get(v) for v in _PROXY_VARIABLES):
        return True
    from urllib.parse import urlparse

    from huggingface_hub import constants

    host = urlparse(constants.ENDPOINT).hostname
    try:
        socket.getaddrinfo(host, 443)
    except (OSError, UnicodeError):
        return False
    return True


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
    missing unless HF_HUB_OFFLINE is set.

    config.json is asked for first (online, that also finds the repository's newest revision); every other
    file comes from the same snapshot, from the cache when it is there (or when the cache records that the
    repository lacks it), else downloaded. Optional and alternative files that cannot be reached (no network)
    count as absent, so a fully cached model loads without network; a required one is an error.
    """
    from huggingface_hub import hf_hub_download, try_to_load_from_cache
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
    unreachable: list[str] = []  # files the hub could not be asked for: after the first, stop trying
    cache_alone = local_only or not hub_resolves()  # no network: the cache, without retries

    def get(filename: str, commit: str | None = None) -> Path | None:
        """The file's path, or None when it is absent (or cannot be had from here)."""
        if commit is not None:
            hit = try_to_load_from_cache(repo, filename, cache_dir=str(cache), revision=commit)
            if isinstance(hit, str):
                return Path(hit)
            if hit is not None:  # the cache records that this snapshot has no such file
                return None
            if local_only or unreachable:
                return None
        try:
            return Path(hf_hub_download(repo, filename, revision=commit or revision, cache_dir=str(cache),
                                        local_files_only=cache_alone))
        except LocalEntryNotFoundError:  # before its base class EntryNotFoundError: not cached, not fetched
            if not local_only:
                unreachable.append(filename)
            return None
        except EntryNotFoundError:  # the repository has no such file (checked online)
            return None
        except GatedRepoError:
            raise CheckpointError(f"{name}: the repository {repo} is gated; accept its terms on "
                                  "huggingface.co and log in (huggingface-cli login)") from None
        except RepositoryNotFoundError:
            raise CheckpointError(f"{name}: no repository {repo} on the Hugging Face hub") from None
        except RevisionNotFoundError:
            raise CheckpointError(f"{name}: the repository {repo} has no revision {revision!r}") from None

    def missing(what: str) -> CheckpointError:
        if local_only:
            return CheckpointError(
                f"{name}: {what} of {repo} is not in the Hugging Face cache {cache}, and HF_HUB_OFFLINE=1 "
                "forbids downloading it; run once with network access (unset HF_HUB_OFFLINE) or point "
                "HF_HUB_CACHE at a cache that holds it")
        if unreachable:
            return CheckpointError(f"{name}: cannot download {what} from the hub repository {repo} and it is "
                                   f"not in the cache {cache} (no network?)")
        return CheckpointError(f"{name}: the repository {repo} has no {what}")

    config = get("config.json")
    if config is None:
        if local_only or unreachable:
            raise missing("config.json")
        raise CheckpointError(f"{name}: the repository {repo} has no config.json, so it is not a timm or "
                              "transformers model folder")
    commit = config.parent.name  # the snapshot folder is named by the commit
    if "model_type" in read_json(config):
        get("preprocessor_config.json", commit)  # optional: transformers' preprocessing, next to config.json
    # Weights already in the snapshot first (the same model as any other file of it), else the preferred one.
    candidates = (*WEIGHT_FILES, *SHARD_INDEXES)
    cached = [f for f in candidates
              if isinstance(try_to_load_from_cache(repo, f, cache_dir=str(cache), revision=commit), str)]
    for weights in cached or candidates:
        path = get(weights, commit)
        if path is None:
            continue
        for shard in shard_names(path) if weights in SHARD_INDEXES else ():
            if get(shard, commit) is None:
                raise missing(f"{shard} (a shard {weights} lists)")
        return config.parent
    if local_only or unreachable:
        raise missing(" or ".join(WEIGHT_FILES))
    raise CheckpointError(f"{name}: the repository {repo} has none of {', '.join(WEIGHT_FILES)} or a shard "
                          f"index ({' / '.join(SHARD_INDEXES)})")
