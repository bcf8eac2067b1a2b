"""Setting up a hosted notebook (Colab, Kaggle).

Opened in Colab or Kaggle, the notebook has the host's own packages (torch among them,
built for its GPU) but not all of ours. `hosted_setup_plan` decides what is missing and
`hosted_setup` installs it, at the versions of ``requirements.txt``, with the host's
torch
pinned as it is so that nothing replaces it. Outside a hosted notebook both do nothing.
The tests check the decisions with the environment faked.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from types import MappingProxyType
from typing import Callable

import torch

# import name → the requirement, as pinned in requirements.txt
HOSTED_PACKAGES = MappingProxyType(
    {
        "sentencepiece": "sentencepiece==0.2.3",
        "sacrebleu": "sacrebleu==2.6.0",
        "sacremoses": "sacremoses==0.2.0",
        "spacy": "spacy==3.8.18",
        "seaborn": "seaborn==0.13.2",
        "matplotlib": "matplotlib==3.11.2",
        "tqdm": "tqdm==4.70.1",
    }
)


def is_hosted(environ, modules) -> bool:
    """Whether this is a hosted notebook (Colab or Kaggle)."""
    return (
        "google.colab" in modules
        or "COLAB_RELEASE_TAG" in environ
        or "KAGGLE_KERNEL_RUN_TYPE" in environ
    )


def hosted_setup_plan(environ, modules, have_module: Callable[[str], bool]) -> dict:
    """What a hosted notebook lacks: ``{"hosted": bool, "install": [requirements]}``.

    ``environ`` and ``modules`` are the environment and ``sys.modules``;
    ``have_module(name)`` says whether a package imports. Outside a hosted notebook the
    list is empty; torch is never installed.
    """
    if not is_hosted(environ, modules):
        return {"hosted": False, "install": []}
    install = [req for name, req in HOSTED_PACKAGES.items() if not have_module(name)]
    return {"hosted": True, "install": install}


def importable(name: str) -> bool:
    """Whether package ``name`` can be imported here (without importing it)."""
    return importlib.util.find_spec(name) is not None


def hosted_setup(plan: dict | None = None, log: Callable = print) -> None:
    """Carry out a :func:`hosted_setup_plan` (by default this process's): pip, with the
    installed torch kept. Outside a hosted notebook it does nothing."""
    if plan is None:
        plan = hosted_setup_plan(os.environ, sys.modules, importable)
    if not plan["install"]:
        return
    pins = Path(tempfile.mkdtemp()) / "keep-torch.txt"
    pins.write_text(f"torch=={torch.__version__}\n")
    log(f"installing {', '.join(plan['install'])} (torch {torch.__version__} kept)")
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "-c", str(pins)]
    subprocess.run([*pip, *plan["install"]], check=True)
