"""vitkit's CPU speed-ups, kept apart from the model: the model (vitkit.model) is plain PyTorch, and these
swap in.

- `accelerate(model)` (accelerate.py): oneDNN/MKL linear layers (linear.py), the attention operator
  (attention.py), an MLP that computes its GELU again in the backward pass (mlp.py) and a LayerNorm that keeps
  its output rather than its input (layer_norm.py) swapped into a model in place, for training and
  evaluation; the same parameters, state dict, function and gradients.
- `vitkit.optimize(model, precision)` (vitkit.inference) for inference builds on the conversions here:
  fused blocks (fused_block.py), oneDNN-packed layers (packed.py), the int8 encoder (int8.py), applied by
  convert.py.
- The compiled operators (csrc/, built by build.py), the hardware probe (hardware.py), the allocator setting
  (allocator.py), and every private PyTorch API these use, each behind a check with a plain fallback
  (private.py).
"""

from .accelerate import accelerate, is_accelerated, plain

__all__ = ["accelerate", "is_accelerated", "plain"]
