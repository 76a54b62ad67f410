"""vitkit: the Vision Transformer of "An Image is Worth 16x16 Words" (Dosovitskiy et al., ICLR 2021).

The names below load on first use (lazy_loader), so that `import vitkit` and the command line's help do not
wait for torch: `vitkit.create_model` imports vitkit.model, and torch with it, when it is first read."""

import lazy_loader

__version__ = "0.1.0"

__getattr__, __dir__, __all__ = lazy_loader.attach(
    __name__,
    submod_attrs={
        "cpu": ["accelerate"],
        "cpu.allocator": ["retain_freed_memory"],
        "checkpoint": ["save"],
        "config": ["ViTConfig", "get_config", "list_models"],
        "inference": ["optimize"],
        "loading": ["load"],  # every format; vitkit.checkpoint.load_vitkit reads the native one
        "counting": ["count_flops", "count_parameters"],
        "model": ["VisionTransformer", "create_model"],
        "posemb": ["resample_pos_embed"],
    },
)
