#!/usr/bin/env bash
# The wheel as a user installs it: built from the tree, installed non-editable into a fresh virtual environment,
# and run from outside the tree: `vitkit --help`, `vitkit.optimize` of a loaded model, and `vitkit predict`.
# The new environment takes its dependencies from .venv (a .pth file points at .venv's packages, so nothing
# is downloaded); pip still checks the wheel's declared dependencies against them. Run by .ci/run after
# `make test`, or alone: bash scripts/wheel_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

"$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$TMP/dist" .
"$PY" -m venv "$TMP/venv"
"$PY" -c "import site; print(site.getsitepackages()[0])" \
    > "$("$TMP/venv/bin/python" -c "import site; print(site.getsitepackages()[0])")/vitkit-deps.pth"
"$TMP/venv/bin/python" -m pip install -q --disable-pip-version-check "$TMP"/dist/vitkit-*.whl

cd "$TMP"  # outside the tree: only the installed wheel can be imported
"$TMP/venv/bin/vitkit" --help > help.txt
grep -q "predict" help.txt
"$TMP/venv/bin/python" - <<'EOF'
import numpy as np
import torch
from PIL import Image

import vitkit

assert vitkit.__file__.startswith(__import__("sys").prefix), f"not the wheel's vitkit: {vitkit.__file__}"
torch.manual_seed(0)
model = vitkit.create_model("ViT-Ti/16", num_classes=3, image_size=32, patch_size=8, depth=2)
torch.nn.init.normal_(model.head.weight, std=0.5)
vitkit.save(model, "model", class_names=["cat", "dog", "fox"])
Image.fromarray(np.random.RandomState(0).randint(0, 255, (40, 48, 3), dtype=np.uint8)).save("image.png")
x = torch.randn(2, 3, 32, 32)
fast = vitkit.optimize(vitkit.load("model"))
torch.testing.assert_close(fast(x), model.eval()(x), rtol=1e-4, atol=1e-4)
EOF
"$TMP/venv/bin/vitkit" predict model image.png --json --top-k 2 > predict.json
"$TMP/venv/bin/python" -c "
import json
got = json.loads(open('predict.json').read())
assert got['path'] == 'image.png' and len(got['labels']) == 2 and set(got['labels']) <= {'cat', 'dog', 'fox'}, got
"
echo "wheel check: $(basename "$TMP"/dist/vitkit-*.whl) installs into a fresh venv; --help, optimize and predict run"
