"""Data for training and evaluation: datasets by name or folder (`resolve`), safe image opening, transforms.
The names load on first use (lazy_loader), so that the augmentation settings load without torch."""

import lazy_loader

__getattr__, __dir__, __all__ = lazy_loader.attach(
    __name__,
    submod_attrs={
        "datasets": [
            "DATASET_NAMES",
            "FASHION_MNIST_CLASSES",
            "ImageFolderDataset",
            "TensorImageDataset",
            "TransformedDataset",
            "load_cifar",
            "load_fashion_mnist",
            "resolve",
        ],
        "download": ["DownloadError"],
        "images": ["BadImageError", "decode_image", "open_image"],
    },
)
