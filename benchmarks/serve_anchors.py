"""The model of `vitkit serve` behind the serving frameworks a user would pick instead, for
benchmarks/bench_serve.py: LitServe (Lightning AI; FastAPI in front, the model in a worker process) and mosec
(a Rust HTTP front end feeding Python worker processes, one per stage, with dynamic batching).

    python benchmarks/serve_anchors.py litserve runs/demo/best --port 8001
    python benchmarks/serve_anchors.py mosec runs/demo/best --port 8002

Both do exactly what `vitkit serve` does for POST /predictions: take a multipart form's `file`, decode it with
vitkit's decoder in the model's colour mode, run vitkit's evaluation transform, batch up to --max-batch-size
requests waiting at most --max-delay-ms, run `vitkit.optimize(model)` (fp32) with --threads PyTorch threads,
and answer the top 5 labels as JSON [{"label", "score"}, ...]. The frameworks come from PyPI (pip install
'vitkit[bench-serve]'); they are not dependencies of vitkit.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

import vitkit
from vitkit.data.images import decode_image
from vitkit.data.transforms import build_eval_transform
from vitkit.inference import optimize
from vitkit.train.predict import label_names, probabilities, top_labels


class Classifier:
    """The served model: decode one upload to a model input, classify a batch of inputs."""

    def __init__(self, path: str, threads: int, warm_up: int = 0):
        torch.set_num_threads(threads)
        model = vitkit.load(path)
        self.net = optimize(model, precision="fp32")
        self.transform = build_eval_transform(model.cfg)
        self.mode = "L" if model.cfg.in_chans == 1 else "RGB"
        self.names = label_names(model)
        # batches of 1 to `warm_up`, as vitkit serve before it is ready: the first call of each shape picks
        # vitkit's kernels, not on a request's path
        x = self.transform(decode_image(blank_png(model.cfg), self.mode))
        for size in range(1, warm_up + 1):
            self.classify([x] * size)

    def decode(self, data: bytes) -> torch.Tensor:
        return self.transform(decode_image(data, self.mode, name="the uploaded image"))

    def classify(self, inputs: list[torch.Tensor]) -> list[list[dict]]:
        with torch.inference_mode():
            probs = probabilities(self.net, torch.stack(inputs))
        return [[{"label": label, "score": score} for label, score in zip(labels, scores, strict=True)]
                for labels, scores in top_labels(probs, self.names, 5)]


def blank_png(cfg) -> bytes:
    import io

    from PIL import Image

    out = io.BytesIO()
    Image.new("L" if cfg.in_chans == 1 else "RGB", tuple(reversed(cfg.image_size))).save(out, format="PNG")
    return out.getvalue()


def form_file(body: bytes) -> bytes:
    """The first part's content of a multipart/form-data body (its boundary is its first line)."""
    delimiter = body[:body.index(b"\r\n")]
    start = body.index(b"\r\n\r\n") + 4
    return body[start:body.index(b"\r\n" + delimiter, start)]


# The frameworks start their workers in processes of their own (spawned), which import this module and find
# the classes here by name; the model's path and threads travel in the environment.
MODEL_ENV, THREADS_ENV, BATCH_ENV = "VITKIT_ANCHOR_MODEL", "VITKIT_ANCHOR_THREADS", "VITKIT_ANCHOR_BATCH"


def from_env(model_stage: bool = True) -> Classifier:
    """The classifier of a worker: the model's stage with its threads, warmed up to the largest batch."""
    if not model_stage:
        return Classifier(os.environ[MODEL_ENV], 1)
    return Classifier(os.environ[MODEL_ENV], int(os.environ[THREADS_ENV]), int(os.environ[BATCH_ENV]))


try:
    import litserve as ls
except ImportError:  # the bench-serve extra
    ls = None
try:
    import mosec
except ImportError:
    mosec = None

if ls is not None:
    class LitServeAPI(ls.LitAPI):
        """LitServe's API: decode_request in the worker per request, predict on the batch."""

        def setup(self, device):
            self.model = from_env()

        def decode_request(self, request):
            return self.model.decode(request["file"].file.read())

        def batch(self, inputs):
            return inputs

        def predict(self, inputs):
            return self.model.classify(inputs)

        def unbatch(self, outputs):
            return outputs

        def encode_response(self, output):
            return output

if mosec is not None:
    class MosecDecode(mosec.Worker):
        """mosec's first stage: the form's file decoded and transformed, one request at a time."""

        def __init__(self):
            super().__init__()
            self.model = from_env(model_stage=False)

        def deserialize(self, data: bytes) -> bytes:
            return form_file(data)

        def forward(self, data: bytes) -> torch.Tensor:
            return self.model.decode(data)

    class MosecInfer(mosec.Worker):
        """mosec's second stage: batches of model inputs through the model."""

        def __init__(self):
            super().__init__()
            self.model = from_env()

        def forward(self, inputs: list[torch.Tensor]) -> list[list[dict]]:
            return self.model.classify(inputs)

        def serialize(self, data: list[dict]) -> bytes:
            return json.dumps(data).encode()  # compact, as the others answer (mosec's own indents)


def run_litserve(args: argparse.Namespace) -> None:
    api = LitServeAPI(max_batch_size=args.max_batch_size, batch_timeout=args.max_delay_ms / 1000)
    server = ls.LitServer(api, accelerator="cpu", workers_per_device=args.processes, timeout=30)
    server.run(port=args.port, log_level="warning", generate_client_file=False,
               num_api_servers=args.processes)


def run_mosec(args: argparse.Namespace) -> None:
    # mosec reads its own options (--port, --timeout in ms, --capacity) from the command line
    sys.argv = [sys.argv[0], "--port", str(args.port), "--capacity", "256", "--timeout", "30000",
                "--log-level", "warning"]
    server = mosec.Server()
    server.append_worker(MosecDecode, num=args.processes)
    server.append_worker(MosecInfer, num=args.processes, max_batch_size=args.max_batch_size,
                         max_wait_time=max(1, round(args.max_delay_ms)))
    server.run()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("framework", choices=("litserve", "mosec"))
    parser.add_argument("model", help="what vitkit.load reads")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--threads", type=int, default=1, help="PyTorch threads of the model's process")
    parser.add_argument("--max-batch-size", type=int, default=16)
    parser.add_argument("--max-delay-ms", type=float, default=10.0)
    parser.add_argument("--processes", type=int, default=1,
                        help="LitServe: API servers and model workers; mosec: processes per stage")
    args = parser.parse_args()
    if {"litserve": ls, "mosec": mosec}[args.framework] is None:
        sys.exit(f"{args.framework} is not installed: pip install 'vitkit[bench-serve]'")
    os.environ[MODEL_ENV], os.environ[THREADS_ENV] = args.model, str(args.threads)
    os.environ[BATCH_ENV] = str(args.max_batch_size)
    (run_litserve if args.framework == "litserve" else run_mosec)(args)


if __name__ == "__main__":
    main()
