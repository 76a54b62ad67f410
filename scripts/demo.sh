#!/usr/bin/env bash
# `make demo`: train a small ViT on Fashion-MNIST (about 5 minutes on 2 CPU cores; it validates on 5,000
# training images it holds out), evaluate it on the 10,000 test images (85 % or more), classify a few test
# images, and say where the checkpoint is.
#   RUN=runs/other make demo     another run folder (default runs/demo); an interrupted demo resumes.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
VITKIT=.venv/bin/vitkit
RUN=${RUN:-runs/demo}

have_fashion_mnist() {
    "$PY" -c "
import sys
from vitkit.data.fashion_mnist import find_fashion_mnist
sys.exit(0 if find_fashion_mnist('train') and find_fashion_mnist('test') else 1)"
}

echo "== 1. Fashion-MNIST"
if ! have_fashion_mnist; then
    # Debian packages it (dataset-fashion-mnist, into /usr/share/datasets/fashion-mnist); else download it
    # from the official location, checked against the published MD5s.
    if command -v apt-get >/dev/null 2>&1; then
        SUDO=""
        if [ "$(id -u)" != 0 ] && command -v sudo >/dev/null 2>&1; then SUDO="sudo -n"; fi
        $SUDO apt-get install -y -q dataset-fashion-mnist >/dev/null 2>&1 \
            && echo "installed dataset-fashion-mnist with apt" \
            || echo "apt could not install dataset-fashion-mnist; downloading instead"
    fi
    if ! have_fashion_mnist; then
        "$PY" -c "from vitkit.data import load_fashion_mnist as f; f('train'); f('test')"
    fi
fi
"$PY" -c "
from vitkit.data.fashion_mnist import find_fashion_mnist
print('found in', find_fashion_mnist('train')[0].parent)"

echo
echo "== 2. train the 'demo' recipe into $RUN (vitkit train demo --out $RUN --resume)"
START=$(date +%s)
"$VITKIT" train demo --out "$RUN" --resume
echo "trained in $(( $(date +%s) - START )) s"

echo
echo "== 3. evaluate on the 10,000 test images (vitkit eval $RUN/last --data fashion-mnist)"
"$VITKIT" eval "$RUN/last" --data fashion-mnist --out "$RUN/eval"

echo
echo "== 4. classify a few test images (vitkit predict $RUN/last $RUN/samples)"
"$PY" - "$RUN/samples" <<'PYTHON'
import sys
from pathlib import Path

from PIL import Image

from vitkit.data import resolve

out = Path(sys.argv[1])
out.mkdir(parents=True, exist_ok=True)
test = resolve("fashion-mnist", "test")
for i in (0, 1, 2, 3, 4, 5, 6, 7):  # the first test images, named by their true class
    name = test.classes[int(test.targets[i])].replace("/", "-").replace(" ", "-")
    Image.fromarray(test.images[i, 0].numpy(), mode="L").save(out / f"test{i:05d}-{name}.png")
print(f"wrote 8 test images to {out}/ (file names give the true class)")
PYTHON
"$VITKIT" predict "$RUN/last" "$RUN/samples" --top-k 3

echo
echo "== the trained model"
echo "checkpoint: $RUN/last   (the best on the 5,000 held-out training images: $RUN/best; training state: $RUN/ckpt/)"
echo "try: $VITKIT info $RUN/last"
echo "     $VITKIT predict $RUN/last path/to/images"
