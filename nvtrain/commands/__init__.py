"""Subcommands of the ``nvtrain`` command, one module each (registered in :mod:`nvtrain.cli`)."""
