"""docs/serving.md's Open Inference Protocol curl lines, run as written against a real server with a photo
over the shell's argument limit for an inline base64 (china.jpg, 196 kB)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("starlette", reason="vitkit serve needs the serve extra: pip install 'vitkit[serve]'")

from serve_helpers import PHOTOS, running_server, tiny_model  # noqa: E402
from vitkit.serve import ModelWorker  # noqa: E402

DOCS = Path(__file__).resolve().parents[1] / "docs" / "serving.md"


def infer_snippet() -> str:
    """The bash block of docs/serving.md that writes infer.json and posts it."""
    blocks = re.findall(r"```bash\n(.*?)```", DOCS.read_text(), flags=re.DOTALL)
    found = [b for b in blocks if "-d @infer.json" in b]
    assert len(found) == 1, "docs/serving.md should show the /infer request posted from a file"
    return found[0]


@pytest.mark.skipif(shutil.which("curl") is None or shutil.which("base64") is None,
                    reason="runs the docs' curl lines: needs curl and base64")
def test_the_docs_infer_request_works_for_a_large_photo(tmp_path):
    photo = tmp_path / "cat.jpg"
    shutil.copy(PHOTOS / "china.jpg", photo)
    assert photo.stat().st_size > 131072  # more than one argument may hold (MAX_ARG_STRLEN), in base64 too
    with running_server(ModelWorker(tiny_model(), "tiny")) as url:
        script = infer_snippet().replace("http://127.0.0.1:8000", url).replace("NAME", "tiny")
        done = subprocess.run(["bash", "-e", "-c", script], cwd=tmp_path, capture_output=True, text=True,
                              timeout=60)
    assert done.returncode == 0, done.stderr
    answer = json.loads(done.stdout)
    names = {o["name"] for o in answer["outputs"]}
    assert names == {"probabilities", "labels"}
