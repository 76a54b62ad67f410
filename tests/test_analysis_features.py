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
        # (a uniform shift of every channel the final LayerNorm would undo)
        model.blocks[0].mlp.fc2.bias.normal_()
    changed = feat.extract_features(model, data, cache=cache, data_key="toy:train", batch_size=4,
                                    progress=False)
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


def test_images_without_a_transform_take_the_models_evaluation_transform():
    """PIL images (and uint8 tensors) need the model's input transform: without one given, it is the model's
    evaluation transform, as evaluate does; float tensors are taken as inputs already. Items a model without a
    config cannot turn into tensors still ask for a transform."""
    from PIL import Image

    from vitkit.data.transforms import build_eval_transform

    model = _model()
    images = [Image.new("RGB", (20, 24), (i * 40, 90, 200 - i * 30)) for i in range(3)]
    data = [(im, i) for i, im in enumerate(images)]
    out = feat.compute_features(model, data, progress=False)
    explicit = feat.compute_features(model, data, transform=build_eval_transform(model.cfg), progress=False)
    torch.testing.assert_close(out.features, explicit.features)
    uint8 = [(torch.full((3, 16, 16), 7 * i, dtype=torch.uint8), i) for i in range(3)]
    assert feat.compute_features(model, uint8, progress=False).features.shape == (3, 32)
    bare = torch.nn.Sequential()  # no cfg: nothing to derive a transform from
    bare.forward_head = lambda x, pre_logits: x.flatten(1)
    bare.forward_features = lambda x: x
    with pytest.raises(ValueError, match="give a transform"):
        feat.compute_features(bare, data, progress=False)


def test_the_model_comes_back_in_the_mode_it_went_in():
    model = _model().train()
    feat.compute_features(model, _dataset(3), progress=False)
    assert model.training
    model.eval()
    feat.compute_features(model, _dataset(3), progress=False)
    assert not model.training


def test_a_cache_of_a_folder_whose_files_changed_is_recomputed(tmp_path):
    """The folder's path, image count and labels stay, its files change (two test classes swapped): the cached
    features and labels are not reused."""
    import os

    from PIL import Image

    from vitkit.data import resolve

    for name, colour in (("a", (250, 0, 0)), ("b", (0, 0, 250))):
        (tmp_path / "data" / name).mkdir(parents=True)
        Image.new("RGB", (16, 16), colour).save(tmp_path / "data" / name / "x.png")
    model, cache = _model(), tmp_path / "f.safetensors"
    first = feat.extract_features(model, resolve(str(tmp_path / "data"), "test"), cache=cache,
                                  data_key="d:test", progress=False)
    a, b = tmp_path / "data" / "a" / "x.png", tmp_path / "data" / "b" / "x.png"
    os.replace(a, tmp_path / "t.png")
    os.replace(b, a)
    os.replace(tmp_path / "t.png", b)
    swapped = feat.extract_features(model, resolve(str(tmp_path / "data"), "test"), cache=cache,
                                    data_key="d:test", progress=False)
    torch.testing.assert_close(swapped.features, first.features.flip(0))
