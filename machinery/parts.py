"""The notebook's definitions, as the machinery uses them.

The package builds on the notebook's parts (the model, batching, the loss, the update
step, the decoders, the vocabularies) and never defines them again. `notebook()` finds
them: the running notebook or script when it is the notebook itself (so that a cell a
reader edits takes effect in Part 4's runs), else the imported module.
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType

MARKER = "ANNOTATED_TRANSFORMER_NOTEBOOK"  # a name only the notebook defines


def notebook() -> ModuleType:
    """The notebook's namespace: ``__main__`` when it is the notebook (run in Jupyter or
    as ``python the_annotated_transformer.py``), else ``the_annotated_transformer``."""
    main = sys.modules.get("__main__")
    if getattr(main, MARKER, False):
        return main
    return importlib.import_module("the_annotated_transformer")
