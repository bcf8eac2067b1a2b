"""The project's public address, read from the one place that names it (our addition).

``CITATION.cff`` at the repository's root says how to cite this reproduction; its
``repository-code`` field is the project's git address. The hosted notebook, the web
page's repository and Colab links and the README take the address from there, and show
no link at all while the field is absent.
"""

from __future__ import annotations

import re
from pathlib import Path

CITATION = Path(__file__).resolve().parents[1] / "CITATION.cff"


def project_url(citation: Path = CITATION) -> str:
    """The ``repository-code`` address of ``citation`` (a CITATION.cff file), or ""
    when the file or the field is absent (the project is not published yet)."""
    try:
        text = citation.read_text(encoding="utf-8")
    except OSError:
        return ""
    match = re.search(r"^repository-code:\s*[\"']?([^\"'\s#]+)", text, re.MULTILINE)
    return match.group(1) if match else ""


def colab_url(address: str, notebook: str = "annotated_transformer.ipynb") -> str:
    """The "Open in Colab" address of ``notebook`` in the GitHub repository
    ``address`` (``https://github.com/OWNER/NAME[.git]``), or "" for any other host or
    an empty address."""
    match = re.fullmatch(r"https://github\.com/([^/]+)/([^/]+?)(?:\.git)?/?", address)
    if not match:
        return ""
    owner, name = match.groups()
    return (
        f"https://colab.research.google.com/github/{owner}/{name}/blob/main/{notebook}"
    )
