"""`nvtrain train` under torchrun seeds every rank alike while the model and data are built, then each rank
apart for training: a data factory's ``random_split`` on the global generator gives every rank the same split."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

#: A job's factories that record, per rank, what the global generator gave them.
FACTORIES = """\
import json, os, pathlib
import torch
from torch.utils.data import DataLoader, TensorDataset, random_split

HERE = pathlib.Path(__file__).parent


def record(key, value):
    path = HERE / f"rank{os.environ.get('RANK', '0')}.json"
    seen = json.loads(path.read_text()) if path.exists() else {}
    path.write_text(json.dumps(seen | {key: value}))


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 2)
        self.drawn = False

    def forward(self, x):
        if not self.drawn:  # the first training step's draw (a dropout mask's, say)
            self.drawn = True
            record("first_draw", torch.rand(1).item())
        return self.linear(x)


def make_model():
    model = Net()
    record("init", model.linear.weight.flatten().tolist())  # before the DDP plugin broadcasts rank 0's
    return model


def make_loaders(batch_size=4):
    generator = torch.Generator().manual_seed(0)
    full = TensorDataset(torch.randn(24, 4, generator=generator), torch.randn(24, 2, generator=generator))
    train, val = random_split(full, [16, 8])  # the global generator, as is common
    record("split", sorted(train.indices))
    return DataLoader(train, batch_size=batch_size, shuffle=True), DataLoader(val, batch_size=batch_size)
"""


@pytest.mark.slow
def test_torchrun_ranks_build_alike_and_train_apart(tmp_path: Path) -> None:
    (tmp_path / "seeded_job.py").write_text(FACTORIES, encoding="utf-8")
    config = tmp_path / "job.yaml"
    config.write_text(
        textwrap.dedent(
            f"""\
            output_dir: {tmp_path / "out"}
            device: cpu
            seed: 3
            model: {{factory: seeded_job:make_model}}
            data: {{factory: seeded_job:make_loaders, kwargs: {{batch_size: 4}}}}
            loss: {{function: torch.nn.functional:mse_loss}}
            trainer: {{max_steps: 2}}
            validation: {{every_n_epochs: null}}
            logging: {{progress_bar: false, tensorboard: false, plot: false}}
            hooks: []
            """
        ),
        encoding="utf-8",
    )
    env = {key: value for key, value in os.environ.items() if not key.startswith("NVTRAIN_")}
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
        "-m", "nvtrain", "train", str(config),
    ]  # fmt: skip
    process = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert process.returncode == 0, process.stderr[-4000:]
    first, second = (json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1))
    assert first["split"] == second["split"]  # no sample trained twice, none in one rank's training and the other's val
    assert first["init"] == second["init"]
    assert first["first_draw"] != second["first_draw"]  # seed + rank once built
    torch.manual_seed(3 + 1)  # rank 1 reseeded with seed + rank after the build: the draws it trains with are
    next(iter(DataLoader(range(1))))  # that stream's, after the training loader's iterator takes its base seed
    assert second["first_draw"] == torch.rand(1).item()
