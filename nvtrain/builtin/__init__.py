"""The built-in example job: the handwritten-digits data set, a small classifier, its config.

``nvtrain train`` with no config file runs :data:`DEFAULT_CONFIG_NAME` from this
package. Everything here is an ordinary import-path target, so a user config can
name it (``nvtrain.builtin.digits:make_loaders``) or replace it with its own.
"""

from __future__ import annotations

from importlib import resources

__all__ = ["DEFAULT_CONFIG_NAME", "default_config_text"]

#: The file name of the built-in config (package data of ``nvtrain.builtin``).
DEFAULT_CONFIG_NAME = "default.yaml"


def default_config_text() -> str:
    """The YAML text of the built-in config."""
    return resources.files(__name__).joinpath(DEFAULT_CONFIG_NAME).read_text(encoding="utf-8")
