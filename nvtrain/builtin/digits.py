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
    """Shuffled training and fixed validation loaders over a seeded split of the digits.

    Each argument is checked by name, so a config's bad value is reported at its key.
    """
    _check_fraction("make_loaders", "val_fraction", val_fraction, "in (0, 1)", 0.0, 1.0, closed=False)
    _check_int("make_loaders", "seed", seed, -(2**63), 2**64 - 1, "from -2**63 to 2**64 - 1")  # torch.manual_seed's
    inputs, labels = load_tensors()
    total = len(labels)
    for name, size in (("batch_size", batch_size), ("val_batch_size", val_batch_size)):  # 2**70 failed in the sampler
        _check_int("make_loaders", name, size, 1, total, f"from 1 to the data set's {total} samples")
    num_val = round(total * val_fraction)
    if not 0 < num_val < total:  # round() reaches 0 or all of them near the ends of (0, 1)
        raise ValueError(
            f"make_loaders: val_fraction must be in (0, 1) and leave at least one training and one validation "
            f"sample (got {val_fraction!r}: {num_val} of the {total} samples for validation, {total - num_val} "
            "for training)"
        )
    order = torch.randperm(total, generator=torch.Generator().manual_seed(seed))
    val_idx, train_idx = order[:num_val], order[num_val:]
    train = TensorDataset(inputs[train_idx], labels[train_idx])
    val = TensorDataset(inputs[val_idx], labels[val_idx])
    train_loader = DataLoader(
        train, batch_size=batch_size, shuffle=True, generator=torch.Generator().manual_seed(seed)
    )
    return train_loader, DataLoader(val, batch_size=val_batch_size)


#: Bounds of the built-in MLP: far above what 8x8 digits need, well below what exhausts memory
#: (``depth: 2**70`` allocated layers until the process was killed).
MAX_HIDDEN = 2**14
MAX_DEPTH = 1024
MAX_PARAMETERS = 2**28


def make_classifier(hidden: int = 128, depth: int = 2, dropout: float = 0.1) -> torch.nn.Module:
    """An MLP: ``depth`` hidden layers of ``hidden`` units (GELU, dropout), then 10 logits.

    Each argument is checked by name, and the size is bounded, so a typo is an error, not an allocation
    that runs until the process is killed.
    """
    _check_int("make_classifier", "hidden", hidden, 1, MAX_HIDDEN, f"from 1 to {MAX_HIDDEN}")
    _check_int("make_classifier", "depth", depth, 1, MAX_DEPTH, f"from 1 to {MAX_DEPTH}")
    _check_fraction("make_classifier", "dropout", dropout, "in [0, 1)", 0.0, 1.0, closed=True)
    parameters = (NUM_FEATURES + 1) * hidden + (depth - 1) * (hidden + 1) * hidden + (hidden + 1) * NUM_CLASSES
    if parameters > MAX_PARAMETERS:
        raise ValueError(
            f"make_classifier: depth={depth} layers of hidden={hidden} units must make at most "
            f"{MAX_PARAMETERS:,} parameters (got {parameters:,}); lower depth or hidden"
        )
    layers: list[torch.nn.Module] = []
    width = NUM_FEATURES
    for _ in range(depth):
        layers += [torch.nn.Linear(width, hidden), torch.nn.GELU(), torch.nn.Dropout(dropout)]
        width = hidden
    layers.append(torch.nn.Linear(width, NUM_CLASSES))
    return torch.nn.Sequential(*layers)


def _check_int(function: str, name: str, value: object, low: int, high: int, expected: str) -> None:
    """Refuse what is not an int in ``[low, high]``, naming the argument (``seed: abc`` reached torch before)."""
    if isinstance(value, bool) or not isinstance(value, int):  # ``batch_size: true`` is a mistake, not a batch of one
        raise TypeError(f"{function}: {name} must be an int {expected} (got {type(value).__name__} {value!r})")
    if not low <= value <= high:
        raise ValueError(f"{function}: {name} must be an int {expected} (got {value!r})")


def _check_fraction(
    function: str, name: str, value: object, expected: str, low: float, high: float, *, closed: bool
) -> None:
    """Refuse a non-number, or one outside ``[low, high)`` (``closed``) or ``(low, high)``, naming the argument."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise TypeError(f"{function}: {name} must be a number {expected} (got {type(value).__name__} {value!r})")
    inside = low <= value < high if closed else low < value < high
    if not inside:  # NaN too
        raise ValueError(f"{function}: {name} must be {expected} (got {value!r})")
