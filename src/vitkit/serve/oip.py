"""The Open Inference Protocol (the v2 protocol of KServe and Triton), in JSON: the model's metadata, and
an inference request's one input checked and turned into model inputs, and the response built from the
probabilities.

Inputs: `image`, BYTES of shape [N], each element an encoded image file (JPEG, PNG, ...) as base64 text; or
`pixel_values`, FP32 of shape [N, C, H, W], the model's preprocessed input. Outputs: `probabilities`, FP32
[N, classes], in the order of the metadata's labels; `labels`, BYTES [N, k], the k most probable labels
(`parameters: {"top_k": k}`, default 5)."""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass

import torch

from .errors import RequestError
from .inputs import tensor_input
from .worker import ModelWorker

IMAGE, PIXELS = "image", "pixel_values"
PROBABILITIES, LABELS = "probabilities", "labels"
DEFAULT_TOP_K = 5


def metadata(worker: ModelWorker) -> dict:
    """GET /v2/models/{name}: the inputs, the outputs and the labels."""
    return {
        "name": worker.name,
        "versions": [],
        "platform": "pytorch_vitkit",
        "inputs": [
            {"name": IMAGE, "datatype": "BYTES", "shape": [-1],
             "parameters": {"content": "encoded image files (JPEG, PNG, ...), base64 in JSON"}},
            {"name": PIXELS, "datatype": "FP32", "shape": [-1, *worker.input_shape],
             "parameters": {"mean": list(worker.cfg.mean), "std": list(worker.cfg.std)}},
        ],
        "outputs": [
            {"name": PROBABILITIES, "datatype": "FP32", "shape": [-1, len(worker.names)]},
            {"name": LABELS, "datatype": "BYTES", "shape": [-1, -1]},
        ],
        "parameters": {"labels": worker.names},
    }


@dataclass
class InferRequest:
    id: str | None
    images: list[bytes] | None  # the BYTES input's elements, or
    pixels: torch.Tensor | None  # the FP32 input, (N, C, H, W)
    outputs: list[str]
    top_k: int


def _field(body: dict, key: str, kind: type, default):
    value = body.get(key, default)
    if not isinstance(value, kind):
        raise RequestError(400, f"{key!r} must be a {kind.__name__}, not {type(value).__name__}")
    return value


def parse_request(raw: bytes, worker: ModelWorker) -> InferRequest:
    """An inference request's JSON body, checked (400 naming what is wrong)."""
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RequestError(400, f"the body is not JSON ({e})") from None
    if not isinstance(body, dict):
        raise RequestError(400, "the body must be a JSON object with 'inputs'")
    inputs = _field(body, "inputs", list, None)
    if len(inputs) != 1 or not isinstance(inputs[0], dict):
        raise RequestError(400, f"{len(inputs)} inputs: send one, {IMAGE!r} (BYTES) or {PIXELS!r} (FP32)")
    tensor = inputs[0]
    name, datatype, shape = tensor.get("name"), tensor.get("datatype"), tensor.get("shape")
    data = tensor.get("data")
    if data is None:
        raise RequestError(400, f"input {name!r} has no 'data'")
    wanted = [o.get("name") if isinstance(o, dict) else o for o in _field(body, "outputs", list, [])]
    unknown = [o for o in wanted if o not in (PROBABILITIES, LABELS)]
    if unknown:
        raise RequestError(400, f"unknown outputs {unknown}: this model gives {PROBABILITIES!r} and "
                                f"{LABELS!r}")
    top_k = _field(body, "parameters", dict, {}).get("top_k", DEFAULT_TOP_K)
    if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 1:
        raise RequestError(400, f"parameters.top_k={top_k!r}: must be an integer of at least 1")
    request_id = body.get("id")
    common = dict(id=None if request_id is None else str(request_id),
                  outputs=wanted or [PROBABILITIES, LABELS], top_k=top_k)
    if name == IMAGE:
        if datatype != "BYTES":
            raise RequestError(400, f"input {IMAGE!r}: datatype {datatype!r}; it is BYTES (base64 image "
                                    "files)")
        if not isinstance(data, list) or not data or shape != [len(data)]:
            raise RequestError(400, f"input {IMAGE!r}: shape {shape!r} with data of {_count(data)}; send "
                                    "shape [N] and a list of N base64 strings")
        return InferRequest(images=[_unbase64(d, i) for i, d in enumerate(data)], pixels=None, **common)
    if name == PIXELS:
        return InferRequest(images=None, pixels=tensor_input(data, shape, datatype, worker.cfg, PIXELS),
                            **common)
    raise RequestError(400, f"unknown input {name!r}: this model takes {IMAGE!r} (BYTES) or {PIXELS!r} "
                            f"(FP32 of shape [N, {', '.join(map(str, worker.input_shape))}])")


def _count(data) -> str:
    return f"{len(data)} elements" if isinstance(data, list) else type(data).__name__


def _unbase64(element, i: int) -> bytes:
    if not isinstance(element, str):
        raise RequestError(400, f"input {IMAGE!r}[{i}] is a {type(element).__name__}; send base64 text")
    try:
        return base64.b64decode(element, validate=True)
    except (binascii.Error, ValueError):
        raise RequestError(400, f"input {IMAGE!r}[{i}] is not valid base64") from None


def response(worker: ModelWorker, request: InferRequest, probs: list[torch.Tensor]) -> dict:
    """The inference response for `probs`, one row of probabilities per image."""
    n, k = len(probs), min(request.top_k, len(worker.names))
    outputs = []
    for name in request.outputs:
        if name == PROBABILITIES:
            outputs.append({"name": PROBABILITIES, "datatype": "FP32", "shape": [n, len(worker.names)],
                            "data": torch.stack(probs).flatten().tolist()})
        else:
            labels = [entry["label"] for p in probs for entry in worker.top(p, k)]
            outputs.append({"name": LABELS, "datatype": "BYTES", "shape": [n, k], "data": labels})
    out = {"model_name": worker.name, "outputs": outputs}
    return out if request.id is None else {"id": request.id, **out}
