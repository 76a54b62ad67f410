"""Data for training and evaluation: datasets by name or folder (`resolve`), safe image opening, transforms."""

from .datasets import (
    DATASET_NAMES,
    FASHION_MNIST_CLASSES,
    ImageFolderDataset,
    TensorImageDataset,
    TransformedDataset,
    load_cifar,
    load_fashion_mnist,
    resolve,
)
from .download import DownloadError
from .images import BadImageError, open_image

__all__ = [
    "DATASET_NAMES",
    "FASHION_MNIST_CLASSES",
    "BadImageError",
    "DownloadError",
    "ImageFolderDataset",
    "TensorImageDataset",
    "TransformedDataset",
    "load_cifar",
    "load_fashion_mnist",
    "open_image",
    "resolve",
]
