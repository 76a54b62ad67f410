"""`vitkit serve`: a model behind HTTP, with dynamic batching, the Open Inference Protocol, Prometheus metrics
and a web page that shows where the model looks. Needs the `serve` extra: `pip install vitkit[serve]`.

    from vitkit.serve import ModelWorker, ServeSettings, create_app
    app = create_app(ModelWorker(vitkit.load("runs/demo/best"), "demo"), ServeSettings(max_batch_size=16))
"""

from .app import ServeSettings, create_app
from .worker import ModelWorker

__all__ = ["ModelWorker", "ServeSettings", "create_app"]
