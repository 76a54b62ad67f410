"""Data for training and evaluation: datasets by name or folder (`resolve`), safe image opening, transforms.
The names load on first use (lazy_loader), so that the augmentation settings load without torch."""

import lazy_loader

__getattr__, __dir__, __all__ = lazy_loader.attach(
    __name__,
    submod_attrs={
        "cifar": ["load_cifar"],
        "datasets": ["DATASET_NAMES", "resolve"],
        "download": ["DownloadError"],
        "fashion_mnist": ["FASHION_MNIST_CLASSES", "load_fashion_mnist"],
        "folders": ["ImageFolderDataset"],
        "hf_folder": ["HFImageDataset", "load_hf_folder"],
        "images": ["BadImageError", "decode_image", "open_image"],
        "shard_writer": ["write_shards"],
        "shards": ["ShardSet", "open_shards"],
        "tensor_dataset": ["TensorImageDataset"],
        "views": ["TransformedDataset"],
    },
)
