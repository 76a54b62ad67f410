"""Hub names through a local Hugging Face cache, offline: no test touches the network."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import vitkit
from convert_reference import randomize_
from vitkit import hub
from vitkit.checkpoint import CheckpointError

timm = pytest.importorskip("timm")

TIMM_NAME = "vit_tiny_patch16_224.augreg_in21k_ft_in1k"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def cache_snapshot(cache: Path, repo: str) -> Path:
    """The folder huggingface_hub's cache layout gives `repo` at its main revision."""
    root = cache / ("models--" + repo.replace("/", "--"))
    (root / "refs").mkdir(parents=True, exist_ok=True)
    (root / "refs" / "main").write_text(COMMIT)
    snapshot = root / "snapshots" / COMMIT
    snapshot.mkdir(parents=True, exist_ok=True)
    return snapshot


def tiny_timm_model():
    from timm.models.vision_transformer import VisionTransformer

    return randomize_(VisionTransformer(img_size=32, patch_size=16, embed_dim=64, depth=1, num_heads=2,
                                        num_classes=1000)).eval()


def put_timm_model(cache: Path, name: str = TIMM_NAME):
    """A small but valid timm hub model under a real timm name: config.json as timm writes it (model_args
    for the reduced size) and model.safetensors."""
    model = tiny_timm_model()
    snapshot = cache_snapshot(cache, f"timm/{name}")
    save_file(model.state_dict(), str(snapshot / "model.safetensors"))
    arch, tag = name.split(".")
    config = {"architecture": arch, "num_classes": 1000, "num_features": 64, "global_pool": "token",
              "model_args": {"img_size": 32, "embed_dim": 64, "depth": 1, "num_heads": 2},
              "pretrained_cfg": {"tag": tag, "input_size": [3, 32, 32], "interpolation": "bicubic",
                                 "crop_pct": 0.9, "mean": [0.5] * 3, "std": [0.5] * 3, "num_classes": 1000}}
    (snapshot / "config.json").write_text(json.dumps(config))
    return model


@pytest.fixture
def offline_cache(tmp_path, monkeypatch):
    cache = tmp_path / "hf-home" / "hub"
    cache.mkdir(parents=True)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def test_timm_name_from_the_cache(offline_cache):
    ref = put_timm_model(offline_cache)
    model = vitkit.load(TIMM_NAME)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(model(x), ref(x), rtol=0, atol=1e-5)
    assert model.cfg.name == TIMM_NAME and model.cfg.num_heads == 2 and model.cfg.crop_pct == 0.9
    assert model.class_names[0] == "tench" and len(model.class_names) == 1000
    # `vitkit info NAME` (its argument arrives as a Path)
    from typer.testing import CliRunner

    from vitkit.cli.main import app

    result = CliRunner().invoke(app, ["info", TIMM_NAME])
    assert result.exit_code == 0 and "64 / 1 / 2 / 256" in result.output, result.output


def test_hf_hub_name_from_the_cache(offline_cache):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.ViTConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=2,
                                 intermediate_size=96, image_size=32, patch_size=16, num_labels=3)
    ref = randomize_(transformers.ViTForImageClassification(cfg)).eval()
    ref.save_pretrained(cache_snapshot(offline_cache, "google/vit-fake-patch16-32"))
    model = vitkit.load("hf-hub:google/vit-fake-patch16-32")
    x = torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(model(x), ref(x).logits, rtol=0, atol=1e-5)
    assert model.cfg.name == "google/vit-fake-patch16-32"


def test_offline_and_not_cached_is_a_clear_error(offline_cache):
    with pytest.raises(CheckpointError, match=r"not in the Hugging Face cache .*HF_HUB_OFFLINE=1 forbids"):
        vitkit.load("vit_base_patch16_224.augreg2_in21k_ft_in1k")
    # config.json cached, weights not: the message says which file is missing
    snapshot = cache_snapshot(offline_cache, "timm/vit_small_patch16_224.augreg_in21k")
    (snapshot / "config.json").write_text(json.dumps({"architecture": "vit_small_patch16_224"}))
    with pytest.raises(CheckpointError, match=r"model.safetensors or pytorch_model.bin of "
                                              r"timm/vit_small_patch16_224.augreg_in21k is not in the"):
        vitkit.load("vit_small_patch16_224.augreg_in21k")


def test_names():
    assert hub.repo_for("hf-hub:google/vit-base-patch16-224") == ("google/vit-base-patch16-224", None)
    assert hub.repo_for("hf-hub:org/repo@v1.0") == ("org/repo", "v1.0")
    assert hub.repo_for(TIMM_NAME) == (f"timm/{TIMM_NAME}", None)
    # a bare architecture takes timm's default pretrained tag
    assert hub.repo_for("vit_base_patch16_224") == ("timm/vit_base_patch16_224.augreg2_in21k_ft_in1k", None)
    assert hub.is_hub_name(TIMM_NAME) and hub.is_hub_name("hf-hub:a/b")
    assert not hub.is_hub_name("weights.npz") and not hub.is_hub_name("runs/model")
    with pytest.raises(CheckpointError, match="expected 'hf-hub:ORG/REPO'"):
        hub.repo_for("hf-hub:just-a-name")


def test_a_missing_local_path_is_not_sent_to_the_hub(tmp_path):
    with pytest.raises(CheckpointError, match=r"model.npz: no such file or folder"):
        vitkit.load(str(tmp_path / "model.npz"))


def test_predict_with_a_hub_cached_timm_model(offline_cache, tmp_path):
    """`vitkit predict <timm-name> cat.jpg`."""
    from typer.testing import CliRunner

    from vitkit.cli.main import app

    if "predict" not in {c.name or c.callback.__name__ for c in app.registered_commands}:
        pytest.skip("the predict command is not registered yet")
    from PIL import Image

    put_timm_model(offline_cache)
    image = tmp_path / "cat.jpg"
    Image.fromarray((torch.rand(40, 50, 3) * 255).to(torch.uint8).numpy()).save(image)
    result = CliRunner().invoke(app, ["predict", TIMM_NAME, str(image)])
    assert result.exit_code == 0, result.output
    from vitkit.convert.common import imagenet_classes

    line = result.output.strip().splitlines()[-1]
    labels = [part.rsplit(" ", 2)[0].strip() for part in line.split(": ", 1)[1].split(", ")]
    assert len(labels) == 5 and all(label in imagenet_classes() for label in labels), line


@pytest.fixture
def no_network(tmp_path, monkeypatch):
    """A hub cache in tmp_path, HF_HUB_OFFLINE unset, and no network: requests go to a closed local port
    (refused at once), and a file the cache lacks fails as hf_hub_download fails without network
    (LocalEntryNotFoundError), without its back-off of retries. Yields (cache, files asked of the hub)."""
    import huggingface_hub
    from huggingface_hub import constants
    from huggingface_hub.errors import LocalEntryNotFoundError

    cache = tmp_path / "hf-home" / "hub"
    cache.mkdir(parents=True)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", "http://127.0.0.1:9/{repo_id}/resolve/{revision}/"
                                                                  "{filename}")
    real = huggingface_hub.hf_hub_download
    asked = []

    def download(repo_id, filename, **kw):
        asked.append(filename)
        try:
            real(repo_id, filename, **{**kw, "local_files_only": True})
        except LocalEntryNotFoundError:
            raise LocalEntryNotFoundError(f"no network and {filename} is not cached") from None
        return real(repo_id, filename, **kw)  # the refused request, then the cached file

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    return cache, asked


def test_a_cached_model_loads_without_network(no_network):
    """Without network (and without HF_HUB_OFFLINE): what the cache holds, or records as absent (.no_exist),
    is not asked of the hub; an optional file it lacks counts as absent."""
    cache, asked = no_network
    ref = put_timm_model(cache)  # a timm repo: config.json and model.safetensors, no preprocessor_config.json
    x = torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(vitkit.load(TIMM_NAME)(x), ref(x), rtol=0, atol=1e-5)
    assert asked == ["config.json"]
    # a transformers repo with only pytorch_model.bin, its preprocessor_config.json recorded as absent
    transformers = pytest.importorskip("transformers")
    cfg = transformers.ViTConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=2,
                                 intermediate_size=96, image_size=32, patch_size=16, num_labels=3)
    hf = randomize_(transformers.ViTForImageClassification(cfg)).eval()
    snapshot = cache_snapshot(cache, "google/vit-bin-only")
    hf.save_pretrained(snapshot)
    from safetensors.torch import load_file

    torch.save(load_file(str(snapshot / "model.safetensors")), snapshot / "pytorch_model.bin")
    (snapshot / "model.safetensors").unlink()
    no_exist = cache / "models--google--vit-bin-only" / ".no_exist" / COMMIT
    no_exist.mkdir(parents=True)
    (no_exist / "preprocessor_config.json").touch()
    asked.clear()
    with torch.no_grad():
        torch.testing.assert_close(vitkit.load("hf-hub:google/vit-bin-only")(x), hf(x).logits, rtol=0,
                                   atol=1e-5)
    assert asked == ["config.json"]
    # not recorded as absent: asked of the hub, unreachable, so absent
    (no_exist / "preprocessor_config.json").unlink()
    asked.clear()
    assert vitkit.load("hf-hub:google/vit-bin-only").cfg.interpolation == "bilinear"
    assert asked == ["config.json", "preprocessor_config.json"]


def test_without_network_a_required_file_is_still_a_clear_error(no_network):
    cache, _ = no_network
    snapshot = cache_snapshot(cache, "timm/vit_small_patch16_224.augreg_in21k")
    (snapshot / "config.json").write_text(json.dumps({"architecture": "vit_small_patch16_224"}))
    with pytest.raises(CheckpointError,
                       match=r"cannot download model.safetensors or pytorch_model.bin from the hub "
                             r"repository timm/vit_small_patch16_224.augreg_in21k and it is not in "
                             r"the cache .* \(no network\?\)"):
        vitkit.load("vit_small_patch16_224.augreg_in21k")
    with pytest.raises(CheckpointError, match=r"hf-hub:org/absent: cannot download config.json from the hub "
                                              r"repository org/absent"):
        vitkit.load("hf-hub:org/absent")


def test_a_sharded_hub_repo_from_the_cache(offline_cache):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.ViTConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                                 intermediate_size=96, image_size=32, patch_size=16, num_labels=3)
    ref = randomize_(transformers.ViTForImageClassification(cfg)).eval()
    snapshot = cache_snapshot(offline_cache, "google/vit-sharded")
    ref.save_pretrained(snapshot, max_shard_size="50KB")
    assert (snapshot / "model.safetensors.index.json").is_file()
    x = torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(vitkit.load("hf-hub:google/vit-sharded")(x), ref(x).logits, rtol=0,
                                   atol=1e-5)
    shard = sorted(snapshot.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(CheckpointError,
                       match=rf"{shard.name} \(a shard model.safetensors.index.json lists\) of "
                             r"google/vit-sharded is not in the Hugging Face cache"):
        vitkit.load("hf-hub:google/vit-sharded")


def test_a_missing_local_name_says_there_is_no_such_file(offline_cache, tmp_path, monkeypatch, capsys):
    """A name that could be a local path: the error says that no such file or folder exists; one with a
    checkpoint file's extension (or a near miss) is never looked up on the hub."""
    from vitkit.cli.main import main

    monkeypatch.chdir(tmp_path)
    with pytest.raises(CheckpointError,
                       match=r"^checkpoint: no such file or folder, and as a hub name: timm knows "
                             r"no pretrained weights on the hub under this name$"):
        vitkit.load("checkpoint")

    def no_hub(name):
        raise AssertionError(f"{name} was looked up on the hub")

    monkeypatch.setattr(hub, "fetch", no_hub)
    for name in ("model.safetensor", "model.safetensors", "vit.pht", "weights.np"):
        assert not hub.is_hub_name(name)
        with pytest.raises(CheckpointError, match=rf"^{re.escape(name)}: no such file or folder$"):
            vitkit.load(name)
    assert hub.is_hub_name("vit_small_patch16_224.dino") and hub.is_hub_name(TIMM_NAME)
    with pytest.raises(SystemExit) as exit_info:
        main(["info", "model.safetensor"])
    err = capsys.readouterr().err
    assert (exit_info.value.code != 0
            and err.startswith("error: model.safetensor: no such file or folder\n")), err


def test_a_hub_host_that_does_not_resolve_reads_the_cache_alone(monkeypatch, tmp_path):
    """Without network huggingface_hub retries each request for about 25 s, with a warning each time; a host
    that does not resolve (and no proxy) sends vitkit to the cache at once."""
    import socket

    import huggingface_hub

    from vitkit import hub

    def no_dns(*args, **kwargs):
        raise socket.gaierror(-2, "Name or service not known")

    for variable in hub._PROXY_VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(hub.socket, "getaddrinfo", no_dns)
    assert not hub.hub_resolves()
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.example:3128")  # the proxy resolves the hub's host
    assert hub.hub_resolves()
    monkeypatch.delenv("HTTPS_PROXY")
    calls = []

    def download(repo_id, filename, **kw):
        calls.append(kw["local_files_only"])
        from huggingface_hub.errors import LocalEntryNotFoundError

        raise LocalEntryNotFoundError("not cached")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    with pytest.raises(CheckpointError, match=r"cannot download config.json .* \(no network\?\)"):
        hub.fetch("vit_small_patch16_224.augreg_in21k")
    assert calls == [True]
