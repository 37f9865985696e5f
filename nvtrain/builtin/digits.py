"""scikit-learn's handwritten digits (1797 8x8 images, shipped inside the package) as loaders.

No download: the data is a file inside the installed scikit-learn package. It is
read directly (the same file ``sklearn.datasets.load_digits`` reads), which spares
the seconds importing scikit-learn and SciPy takes; if the file is not where it
is expected, ``load_digits`` is used. The split is deterministic in ``seed`` so a
resumed run sees the same training set.
"""

from __future__ import annotations

import gzip
import importlib.util
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset

__all__ = ["NUM_CLASSES", "NUM_FEATURES", "load_tensors", "make_classifier", "make_loaders"]

NUM_FEATURES = 64
NUM_CLASSES = 10


def digits_file() -> Path | None:
    """The digits CSV inside the installed scikit-learn, found without importing it (None if absent)."""
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        path = Path(location) / "datasets" / "data" / "digits.csv.gz"
        if path.is_file():
            return path
    return None


def load_tensors() -> tuple[torch.Tensor, torch.Tensor]:
    """All 1797 images as float32 rows scaled to [0, 1], and their int64 labels."""
    import numpy

    path = digits_file()
    if path is not None:
        with gzip.open(path, "rt", encoding="ascii") as file:
            table = numpy.loadtxt(file, delimiter=",", dtype=numpy.float64)
        images, labels = table[:, :-1], table[:, -1].astype(numpy.int64)
    else:
        try:
            from sklearn.datasets import load_digits
        except ImportError as err:
            raise ImportError(
                "the built-in digits data set needs scikit-learn: pip install 'nvtrain[cli]'"
            ) from err
        images, labels = load_digits(return_X_y=True)
    inputs = torch.from_numpy(images).to(torch.float32) / 16.0
    return inputs, torch.from_numpy(labels).to(torch.int64)


def make_loaders(
    batch_size: int = 64,
    val_fraction: float = 0.2,
    seed: int = 0,
    val_batch_size: int = 512,
) -> tuple[DataLoader[tuple[torch.Tensor, ...]], DataLoader[tuple[torch.Tensor, ...]]]:
    """Shuffled training and fixed validation loaders over a seeded split of the digits."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"make_loaders: val_fraction must be in (0, 1) (got {val_fraction!r})")
    if batch_size < 1 or val_batch_size < 1:
        raise ValueError(f"make_loaders: batch sizes must be >= 1 (got {batch_size}, {val_batch_size})")
    inputs, labels = load_tensors()
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    num_val = round(len(labels) * val_fraction)
    val_idx, train_idx = order[:num_val], order[num_val:]
    train = TensorDataset(inputs[train_idx], labels[train_idx])
    val = TensorDataset(inputs[val_idx], labels[val_idx])
    train_loader = DataLoader(
        train, batch_size=batch_size, shuffle=True, generator=torch.Generator().manual_seed(seed)
    )
    return train_loader, DataLoader(val, batch_size=val_batch_size)


def make_classifier(hidden: int = 128, depth: int = 2, dropout: float = 0.1) -> torch.nn.Module:
    """An MLP: ``depth`` hidden layers of ``hidden`` units (GELU, dropout), then 10 logits."""
    if hidden < 1 or depth < 1:
        raise ValueError(f"make_classifier: hidden and depth must be >= 1 (got {hidden}, {depth})")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"make_classifier: dropout must be in [0, 1) (got {dropout!r})")
    layers: list[torch.nn.Module] = []
    width = NUM_FEATURES
    for _ in range(depth):
        layers += [torch.nn.Linear(width, hidden), torch.nn.GELU(), torch.nn.Dropout(dropout)]
        width = hidden
    layers.append(torch.nn.Linear(width, NUM_CLASSES))
    return torch.nn.Sequential(*layers)
