"""Setting up a hosted notebook (Colab, Kaggle).

Opened in Colab or Kaggle, the notebook has the host's own packages (torch among them,
built for its GPU), not all of ours, and some of ours at other versions.
`hosted_setup_plan` decides what is missing or at another version than
``requirements.txt`` pins (by the installed distributions' versions, not by whether a
package imports) and `hosted_setup` installs those at the pinned versions, with the
host's torch pinned as it is so that nothing replaces it. Outside a hosted notebook both
do nothing. The tests check the decisions with the environment faked.

The notebook's set-up cell runs this file as a script, before the package is imported
(``python machinery/hosted.py`` and the names of the kernel's imported modules): a
failed install is one line and a non-zero exit.
"""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from types import MappingProxyType
from typing import Callable, Optional, Sequence

import torch

# import name → the requirement, as pinned in requirements.txt
HOSTED_PACKAGES = MappingProxyType(
    {
        "sentencepiece": "sentencepiece==0.2.3",
        "sacrebleu": "sacrebleu==2.6.0",
        "sacremoses": "sacremoses==0.2.0",
        "spacy": "spacy==3.8.18",
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


# Epochs that fit a free hosted session on a GPU (Part 4's IWSLT14 paragraph).
HOSTED_EPOCHS = 15


def iwslt_run_choice(on_gpu: bool, environ, modules) -> tuple[str, dict]:
    """Part 4's IWSLT14 run (our addition): ``(preset, overrides)``. On a GPU the full
    recipe, `iwslt14-small`; on a CPU `iwslt14-sample`. In a hosted notebook on a GPU
    it trains ``HOSTED_EPOCHS`` epochs to fit a free session, unless
    ``ANNOTATED_TRANSFORMER_FULL=1`` asks for the preset's own schedule."""
    preset = "iwslt14-small" if on_gpu else "iwslt14-sample"
    full = environ.get("ANNOTATED_TRANSFORMER_FULL") == "1"
    short = on_gpu and is_hosted(environ, modules) and not full
    return preset, ({"epochs": HOSTED_EPOCHS} if short else {})


def hosted_setup_plan(
    environ, modules, version_of: Callable[[str], Optional[str]]
) -> dict:
    """What a hosted notebook lacks: ``{"hosted": bool, "install": [requirements],
    "found": {requirement: what is there}}``.

    ``environ`` and ``modules`` are the environment and ``sys.modules``;
    ``version_of(name)`` is the installed version of distribution ``name`` (None when
    it is not installed). A package at another version than its pin is installed again
    at the pin. Outside a hosted notebook the list is empty; torch is never installed.
    """
    if not is_hosted(environ, modules):
        return {"hosted": False, "install": [], "found": {}}
    found = {}
    for req in HOSTED_PACKAGES.values():
        name, pinned = req.split("==")
        version = version_of(name)
        if version != pinned:
            found[req] = "not installed" if version is None else f"{version} installed"
    return {"hosted": True, "install": list(found), "found": found}


def installed_version(name: str) -> Optional[str]:
    """The installed version of distribution ``name``, or None when it is absent."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def hosted_setup(
    plan: dict | None = None, log: Callable = print, loaded: Sequence[str] = ()
) -> None:
    """Carry out a :func:`hosted_setup_plan` (by default this process's): pip, with the
    installed torch kept. Outside a hosted notebook it does nothing. ``loaded`` names
    the modules the notebook's kernel has imported (this process's too are counted)."""
    if plan is None:
        plan = hosted_setup_plan(os.environ, sys.modules, installed_version)
    if not plan["install"]:
        return
    pins = Path(tempfile.mkdtemp()) / "keep-torch.txt"
    pins.write_text(f"torch=={torch.__version__}\n")
    found = plan.get("found", {})
    said = [f"{req} ({found[req]})" if req in found else req for req in plan["install"]]
    log(f"installing {', '.join(said)}; torch {torch.__version__} kept")
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "-c", str(pins)]
    subprocess.run([*pip, *plan["install"]], check=True)
    imported = {*sys.modules, *loaded}
    loaded = [r.split("==")[0] for r in plan["install"] if r.split("==")[0] in imported]
    if loaded:
        log(
            f"{', '.join(loaded)} were imported before: restart the runtime and run "
            "the notebook again to use the installed versions"
        )


if __name__ == "__main__":
    try:
        hosted_setup(loaded=sys.argv[1:])
    except (OSError, subprocess.CalledProcessError) as e:
        sys.exit(f"installing the notebook's packages failed: {e}")
