"""DeiT's distillation token and hard distillation: the model against timm's VisionTransformerDistilled, its
checkpoints both ways, the teacher's view of a batch, the loss, and a run taught by a teacher."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

import vitkit
from convert_reference import assert_same, randomize_
from train_helpers import synthetic_dataset
from vitkit.config import ViTConfig
from vitkit.convert import write
from vitkit.model import VisionTransformer, create_model
from vitkit.shortcut import with_class_token_shortcut
from vitkit.train import train
from vitkit.train.distill import Teacher, hard_distillation_loss
from vitkit.train.one_step import forward_backward
from vitkit.train.recipes import get_recipe

timm = pytest.importorskip("timm")
from timm.models.deit import VisionTransformerDistilled  # noqa: E402

SMALL = dict(img_size=32, patch_size=8, embed_dim=64, depth=2, num_heads=2, num_classes=5)


def timm_distilled(seed: int = 1) -> VisionTransformerDistilled:
    return randomize_(VisionTransformerDistilled(**SMALL), seed).eval()


def vitkit_distilled(seed: int = 1) -> VisionTransformer:
    cfg = ViTConfig(image_size=(32, 32), patch_size=8, dim=64, depth=2, num_heads=2, mlp_dim=256,
                    num_classes=5, distilled=True)
    return randomize_(VisionTransformer(cfg), seed).eval()


def test_the_model_is_timms_distilled_vit_in_evaluation_and_in_training():
    ours, ref = vitkit_distilled(), timm_distilled()
    ref.load_state_dict(ours.state_dict())  # the same names: dist_token, head_dist, pos_embed of N + 2 rows
    assert ours.cfg.num_prefix_tokens == 2 and ours.pos_embed.shape[1] == 16 + 2
    x = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        assert_same(ours(x), ref(x), "distilled ViT (mean of the two heads) vs timm")
        assert_same(with_class_token_shortcut(ours)(x), ref(x), "with the prefix-token shortcut vs timm")
    ours.train().set_distilled_training(True)
    ref.train().set_distilled_training(True)
    with torch.no_grad():
        (cls, dist), (ref_cls, ref_dist) = ours(x), ref(x)
    assert_same(cls, ref_cls, "class head")
    assert_same(dist, ref_dist, "distillation head")
    assert (cls - dist).abs().max() > 1e-3  # two heads on two tokens


def test_timm_and_deit_files_load_and_write_back(tmp_path):
    ref = timm_distilled()
    path = tmp_path / "deit_small_distilled_patch16_224.safetensors"
    save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, str(path))
    x = torch.randn(2, 3, 32, 32)
    ours = vitkit.load(path, num_heads=2, image_size=32)  # a shape the name does not give: said
    assert ours.cfg.distilled and ours.cfg.mean == (0.485, 0.456, 0.406)  # DeiT's ImageNet normalisation
    with torch.no_grad():
        assert_same(ours(x), ref(x), "a DeiT distilled state dict vs timm")
    folder = write(ours, tmp_path / "timm", "timm")
    config = json.loads((folder / "config.json").read_text())
    assert config["architecture"] == "deit_base_distilled_patch16_224"  # its builder, with model_args
    back = timm.create_model(f"local-dir:{folder}", pretrained=True).eval()
    assert isinstance(back, VisionTransformerDistilled)
    again = vitkit.load(write(ours, tmp_path / "vitkit", "vitkit"))
    with torch.no_grad():
        assert_same(back(x), ref(x), "vitkit's timm folder, read by timm")
        assert_same(again(x), ref(x), "vitkit's own folder, read back")


def test_a_distillation_token_needs_the_class_tokens_pooling():
    with pytest.raises(ValueError, match="distilled=True .* needs pool='token'"):
        ViTConfig(distilled=True, pool="gap")


def test_reset_classifier_replaces_both_heads():
    model = vitkit_distilled()
    model.reset_classifier(3)
    assert model.head.weight.shape == model.head_dist.weight.shape == (3, 64)
    assert model.head_dist.weight.abs().sum() == 0 and model.cfg.num_classes == 3


def test_the_teacher_sees_the_batch_at_its_own_size_and_normalisation():
    teacher_model = create_model(ViTConfig(image_size=(32, 32), patch_size=8, in_chans=1, dim=32, depth=1,
                                           num_heads=2, mlp_dim=64, num_classes=4, mean=(0.5,), std=(0.25,)))
    randomize_(teacher_model, 3).eval()
    student = ViTConfig(image_size=(28, 28), patch_size=7, in_chans=1, num_classes=4, dim=32, depth=1,
                        num_heads=2, mlp_dim=64, mean=(0.2860,), std=(0.3530,), interpolation="bilinear")
    pixels = torch.rand(6, 1, 28, 28)
    x = (pixels - 0.2860) / 0.3530  # the student's batch
    want = F.interpolate((pixels - 0.5) / 0.25, size=(32, 32), mode="bicubic", align_corners=False)
    classes = Teacher(teacher_model, student, num_classes=4)(x)
    with torch.no_grad():
        assert torch.equal(classes, teacher_model(want).argmax(-1))
    with pytest.raises(ValueError, match="has 4 classes, the training data 10"):
        Teacher(teacher_model, student, num_classes=10)


def test_the_hard_distillation_loss_and_its_gradients():
    torch.manual_seed(0)
    cls, dist = torch.randn(8, 5), torch.randn(8, 5)
    y, t = torch.randint(0, 5, (8,)), torch.randint(0, 5, (8,))
    base = lambda logits, labels: F.cross_entropy(logits, labels, label_smoothing=0.1)  # noqa: E731
    loss = hard_distillation_loss(base, 0.25)
    want = 0.75 * F.cross_entropy(cls, y, label_smoothing=0.1) + 0.25 * F.cross_entropy(dist, t)
    assert torch.allclose(loss((cls, dist), y, t), want)
    # a student without a distillation token: its class head takes both terms
    want = 0.75 * F.cross_entropy(cls, y, label_smoothing=0.1) + 0.25 * F.cross_entropy(cls, t)
    assert torch.allclose(loss(cls, y, t), want)


def test_forward_backward_teaches_the_distillation_head_with_the_teachers_classes():
    model = vitkit_distilled().train()
    model.set_distilled_training(True)
    x, y = torch.randn(4, 3, 32, 32), torch.randint(0, 5, (4,))
    fixed = torch.tensor([1, 1, 4, 0])
    loss_fn = hard_distillation_loss(lambda logits, labels: F.cross_entropy(logits, labels), 1.0)
    forward_backward(model, [(x, y)], loss_fn, torch.device("cpu"), None, teacher=lambda images: fixed)
    assert model.head.weight.grad.abs().sum() == 0  # weight 1: the labels' head learns nothing
    cls, dist = model(x)
    expected = torch.autograd.grad(F.cross_entropy(dist, fixed), model.head_dist.weight)[0]
    assert torch.allclose(model.head_dist.weight.grad, expected, atol=1e-6)


def test_a_run_taught_by_a_teacher(tmp_path):
    """A tiny teacher trained, then a distilled student taught by it: the run records its teacher and saves a
    model whose forward averages the two heads."""
    data = dict(train_set=synthetic_dataset(96, 0), val_set=synthetic_dataset(32, 1), progress=False)
    with pytest.raises(ValueError, match="recipe learns from a teacher: set teacher=MODEL"):
        train(get_recipe("fashion-mnist-distilled-tiny"), tmp_path / "untaught", **data)
    train(get_recipe("fashion-mnist-teacher-tiny", ["steps=4"]), tmp_path / "teacher", **data)
    taught = f"teacher={tmp_path / 'teacher' / 'best'}"
    student_cfg = get_recipe("fashion-mnist-distilled-tiny", ["steps=4", taught])
    train(student_cfg, tmp_path / "student", **data)
    saved = json.loads((tmp_path / "student" / "config.json").read_text())
    assert saved["teacher"] == str(tmp_path / "teacher" / "best") and saved["model"]["distilled"] is True
    student = vitkit.load(tmp_path / "student" / "best")
    assert student.cfg.distilled and student.head_dist.weight.abs().sum() > 0  # the distillation head learnt
    assert student(torch.randn(2, 1, 28, 28)).shape == (2, 10)


def test_hugging_faces_deit_with_teacher_loads_and_its_plain_deit_is_refused(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.DeiTConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=96, image_size=32, patch_size=8, num_labels=3)
    ref = randomize_(transformers.DeiTForImageClassificationWithTeacher(config)).eval()
    ref.save_pretrained(tmp_path / "hf")
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        ours = vitkit.load(tmp_path / "hf")
        assert_same(ours(x), ref(x).logits, "HF DeiTForImageClassificationWithTeacher vs transformers")
    assert ours.cfg.distilled and ours.cfg.num_heads == 4
    with pytest.raises(ValueError, match="no distillation token"):
        write(ours, tmp_path / "back", "hf")
    transformers.DeiTForImageClassification(config).save_pretrained(tmp_path / "plain")
    with pytest.raises(vitkit.checkpoint.CheckpointError, match="reads the class token alone"):
        vitkit.load(tmp_path / "plain")


def test_the_speed_ups_keep_both_prefix_tokens():
    """vitkit.optimize (the prefix-token shortcut in the last block) and vitkit.accelerate (training) compute
    the plain distilled model's logits, and in training its pair of heads."""
    import copy

    model = vitkit_distilled()
    x = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        assert_same(vitkit.optimize(copy.deepcopy(model), "fp32")(x), model(x), "optimize fp32, distilled")
    fast = vitkit.accelerate(copy.deepcopy(model)).train()
    model.train()
    for m in (fast, model):
        m.set_distilled_training(True)
    for ours, ref, head in zip(fast(x), model(x), ("class", "distillation"), strict=True):
        assert_same(ours.detach(), ref.detach(), f"accelerate in training, {head} head")
