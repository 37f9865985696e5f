"""A model factory for ``custom-model.yaml``: a small convolutional net over the 8x8 digits.

``nvtrain train examples/configs/custom-model.yaml`` imports this module by the
import path ``my_model:build_cnn``: modules beside a config file are importable.
"""

from __future__ import annotations

import torch


class DigitsCNN(torch.nn.Module):
    """Two 3x3 convolutions and a linear head; takes the flat 64-pixel rows the loader yields."""

    def __init__(self, channels: int = 16, dropout: float = 0.1) -> None:
        super().__init__()
        self.features = torch.nn.Sequential(
            torch.nn.Conv2d(1, channels, 3, padding=1),
            torch.nn.GELU(),
            torch.nn.Conv2d(channels, 2 * channels, 3, padding=1),
            torch.nn.GELU(),
            torch.nn.MaxPool2d(2),
        )
        self.head = torch.nn.Sequential(
            torch.nn.Flatten(), torch.nn.Dropout(dropout), torch.nn.Linear(2 * channels * 4 * 4, 10)
        )

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(pixels.view(-1, 1, 8, 8)))


def build_cnn(channels: int = 16, dropout: float = 0.1) -> torch.nn.Module:
    """What the config's ``model.factory`` names; ``model.kwargs`` become these arguments."""
    return DigitsCNN(channels=channels, dropout=dropout)
