"""Shared test setup: the repository root on sys.path and the data mirror fixture."""
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


@pytest.fixture(scope="session")
def mirror() -> Path:
    """The local data mirror: $DATA_MIRROR, else ../shared/data beside the repository."""
    path = Path(os.environ.get("DATA_MIRROR") or ROOT.parent / "shared" / "data")
    if not path.is_dir():
        pytest.skip(f"no data mirror at {path}")
    return path
