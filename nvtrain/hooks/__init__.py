"""Built-in hooks, and (lazily) the hook classes of installed plugins.

``from nvtrain.hooks import GradientAccumulationHook`` imports a built-in;
``from nvtrain.hooks import MixedPrecisionHook`` imports the class from the
installed ``nvtrain-amp`` distribution, or raises ImportError naming it.
"""

from __future__ import annotations

from typing import Any

# --- built-in hooks (core update policies and observers) -----------------------
# BEGIN BUILTINS
__all__: list[str] = []
# END BUILTINS


# --- lazily re-exported plugin hooks --------------------------------------------
# BEGIN PLUGIN EXPORTS
def __getattr__(name: str) -> Any:
    raise AttributeError(f"module 'nvtrain.hooks' has no attribute {name!r}")
# END PLUGIN EXPORTS
