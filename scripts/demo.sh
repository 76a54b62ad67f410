#!/usr/bin/env bash
# `make demo`: what vitkit holds so far. The ViT-S presets as a table, then one forward pass of a randomly
# initialised ViT-S/16 on a random 224 x 224 image, with the shapes of what comes out.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python

echo "== vitkit models ViT-S"
.venv/bin/vitkit models ViT-S

echo
echo "== a forward pass of ViT-S/16 (random weights, random image)"
"$PY" - <<'PYTHON'
import time

import torch

import vitkit

torch.manual_seed(0)
model = vitkit.create_model("ViT-S/16").eval()
cfg = model.cfg
image = torch.rand(1, cfg.in_chans, *cfg.image_size)
x = (image - torch.tensor(cfg.mean)[:, None, None]) / torch.tensor(cfg.std)[:, None, None]
start = time.perf_counter()
with torch.no_grad():
    features, attentions = model.forward_features(x, return_attention=True)
    logits = model.forward_head(features)
seconds = time.perf_counter() - start
print(f"image {tuple(x.shape)} -> tokens {tuple(features.shape)} -> logits {tuple(logits.shape)}")
print(f"{len(attentions)} attention maps of shape {tuple(attentions[0].shape)}, rows sum to "
      f"{attentions[-1].sum(-1).mean().item():.4f}")
print(f"logits are all zero ({bool((logits == 0).all())}): the fine-tuning head starts at zero, as in the paper")
print(f"{sum(p.numel() for p in model.parameters()):,} parameters, forward in {seconds * 1000:.0f} ms on the CPU")
PYTHON
