"""``python -m nvtrain ...`` runs the ``nvtrain`` command."""

from __future__ import annotations

import sys

from nvtrain.cli import main

sys.exit(main())
