"""vitkit.tensor_reader: safetensors files read into aligned memory of their own, equal to what safetensors
itself reads, and a clear error for what is not such a file."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from vitkit.tensor_reader import FormatError, read_safetensors


def test_every_dtype_and_shape_reads_as_safetensors_reads_it_into_aligned_memory(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {
        "f32": torch.randn(3, 5, generator=g), "f64": torch.randn(7, generator=g, dtype=torch.float64),
        "f16": torch.randn(2, 3, generator=g).half(), "bf16": torch.randn(4, 1, generator=g).bfloat16(),
        "i64": torch.arange(6).reshape(2, 3), "i32": torch.tensor([1, -2], dtype=torch.int32),
        "i16": torch.tensor([3], dtype=torch.int16), "i8": torch.tensor([-4, 5], dtype=torch.int8),
        "u8": torch.tensor([250], dtype=torch.uint8), "bool": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5), "empty": torch.zeros(0, 4),
    }
    save_file(tensors, str(tmp_path / "t.safetensors"), metadata={"format": "pt"})
    ours, theirs = read_safetensors(tmp_path / "t.safetensors"), load_file(str(tmp_path / "t.safetensors"))
    assert ours.keys() == theirs.keys() == tensors.keys()
    for k, t in ours.items():
        assert t.dtype == theirs[k].dtype and t.shape == theirs[k].shape and torch.equal(t, theirs[k]), k
        assert t.numel() == 0 or t.data_ptr() % 64 == 0, k  # PyTorch's alignment, which the kernels expect
    assert len({t.untyped_storage().data_ptr() for t in ours.values() if t.numel()}) == len(tensors) - 1


@pytest.mark.parametrize("damage, message", [
    (lambda b: b[:-3], "the file ends before|bytes of data"),
    (lambda b: b[:5], "shorter than a safetensors header"),
    (lambda b: (10**12).to_bytes(8, "little") + b[8:], "a header of 1000000000000 bytes"),
    (lambda b: b[:8] + b"x" + b[9:], "not JSON"),
])
def test_a_damaged_file_is_refused_with_the_reason(tmp_path, damage, message):
    save_file({"w": torch.ones(4, 4)}, str(tmp_path / "ok.safetensors"))
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(damage((tmp_path / "ok.safetensors").read_bytes()))
    with pytest.raises(FormatError, match=message):
        read_safetensors(bad)
