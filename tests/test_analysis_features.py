"""Batched feature extraction and its safetensors cache."""

import pytest
import torch

from vitkit import create_model
from vitkit.analysis import features as feat


def _model():
    return create_model("ViT-Ti/16", image_size=16, patch_size=8, dim=32, depth=1, num_heads=2, mlp_dim=64,
                        num_classes=3).eval()


def _dataset(n=10):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(3, 16, 16, generator=g), i % 3) for i in range(n)]


def test_features_are_the_pre_logits_representation_in_order():
    model, data = _model(), _dataset()
    out = feat.compute_features(model, data, batch_size=4, progress=False)
    x = torch.stack([im for im, _ in data])
    with torch.no_grad():
        expected = model.forward_head(model.forward_features(x), pre_logits=True)
    torch.testing.assert_close(out.features, expected)
    assert out.labels.tolist() == [y for _, y in data]
    assert feat.compute_features(model, data, batch_size=3, limit=5, progress=False).features.shape == (5, 32)


def test_cache_is_reused_only_for_the_same_model_and_data(tmp_path, monkeypatch):
    model, data = _model(), _dataset()
    cache = tmp_path / "f.safetensors"
    first = feat.extract_features(model, data, cache=cache, data_key="toy:test", batch_size=4, progress=False)
    assert cache.is_file()
    calls = []
    real = feat.compute_features

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(feat, "compute_features", counting)
    again = feat.extract_features(model, data, cache=cache, data_key="toy:test", batch_size=4, progress=False)
    assert calls == []  # read from the file
    torch.testing.assert_close(again.features, first.features)
    assert torch.equal(again.labels, first.labels)
    feat.extract_features(model, data, cache=cache, data_key="toy:train", batch_size=4, progress=False)
    assert len(calls) == 1  # other data: recomputed
    with torch.no_grad():
        model.blocks[0].mlp.fc2.bias.add_(1.0)
    changed = feat.extract_features(model, data, cache=cache, data_key="toy:train", batch_size=4, progress=False)
    assert len(calls) == 2  # other weights: recomputed
    assert not torch.allclose(changed.features, first.features)
    cache.write_bytes(b"not a safetensors file")
    feat.extract_features(model, data, cache=cache, data_key="toy:train", batch_size=4, progress=False)
    assert len(calls) == 3  # a broken cache is recomputed and overwritten


def test_fingerprint_tracks_the_weights():
    a, b = _model(), _model()
    b.load_state_dict(a.state_dict())
    assert feat.model_fingerprint(a) == feat.model_fingerprint(b)
    with torch.no_grad():
        b.head.weight[0, 0] = 1e-3
    assert feat.model_fingerprint(a) != feat.model_fingerprint(b)


def test_items_that_are_not_tensors_need_a_transform():
    from PIL import Image

    data = [(Image.new("RGB", (16, 16)), 0)]
    with pytest.raises(ValueError, match="give a transform"):
        feat.compute_features(_model(), data, progress=False)
    out = feat.compute_features(_model(), data, transform=lambda im: torch.zeros(3, 16, 16), progress=False)
    assert out.features.shape == (1, 32)
