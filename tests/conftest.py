"""Shared test setup: the repository root on sys.path, the data mirror fixture, and small helpers."""

import os
import re
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


@pytest.fixture(scope="session")
def mirror() -> Path:
    """The local data mirror: $DATA_MIRROR, else ../shared/data beside the repository."""
    path = Path(os.environ.get("DATA_MIRROR") or ROOT.parent / "shared" / "data")
    if not path.is_dir():
        pytest.skip(f"no data mirror at {path}")
    return path


def load_script(path: Path, name: str):
    """A script that is not part of the package (web/build.py, benchmarks/table3.py) as
    a module, under ``name`` (one no installed package uses)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # a dataclass in it looks its module up by name
    spec.loader.exec_module(module)
    return module


def quiet(*args, **kwargs):
    """A ``log`` that prints nothing."""


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread: these tests share a small machine, and results must not depend on it."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def tiny_cfg(run_dir, **overrides):
    """The copy preset shrunk to a one-layer model; ``batch_tokens=240`` → 20 pairs, 10 batches per epoch.

    float32 whatever the CPU (exact comparisons); the precision tests (test_devices.py) ask for theirs.
    """
    import machinery

    settings = dict(
        N=1,
        d_model=32,
        d_ff=64,
        h=4,
        epochs=1,
        batch_tokens=240,
        warmup=50,
        device="cpu",
        precision="fp32",
        attention="readable",
        run_dir=str(run_dir),
    )
    settings.update(overrides)
    return machinery.get_config("copy", **settings)


def tiny_data(cfg):
    """200 / 40 / 20 copy pairs of 10 symbols (12 ids with <s> and </s>)."""
    import machinery

    return machinery.make_copy_data(cfg, sizes=(200, 40, 20))


def run(cfg, data, **kwargs) -> dict:
    """Train ``cfg`` on ``data`` quietly, without the test-set evaluation unless asked."""
    import machinery

    return machinery.train(
        cfg, data=data, log=quiet, progress=False, **{"evaluate": False, **kwargs}
    )


def last_state(run_dir) -> dict:
    """The newest checkpoint of ``run_dir``, loaded."""
    import machinery

    paths = machinery.checkpoint_paths(run_dir)
    assert paths, f"no checkpoint in {run_dir}"
    return machinery.load_checkpoint(paths[-1])


# The paper's wording by section, beside the repository (not part of it).
PAPER = ROOT.parent / "shared" / "paper" / "README.md"
GAP = "[…]"  # the elision mark inside a quotation

# Inline quotations of the paper: text in double quotes followed, within a few
# characters, by its section in parentheses, e.g. "a rate of 0.1" (§5.4).
INLINE_QUOTE = re.compile(r'["“]([^"”]{6,}?)["”][^"“]{0,3}\((?:the paper, )?(§[\d.]+)')


def squash(text: str) -> str:
    """``text`` without whitespace: quotations compare across line breaks."""
    return re.sub(r"\s+", "", text)


def inline_quotes(text: str) -> list[tuple[str, str]]:
    """The (quotation, section) pairs of ``text``, its line breaks read as spaces."""
    return INLINE_QUOTE.findall(" ".join(text.split()))


def paper_sections(paper: str) -> dict[str, str]:
    """The paper's excerpts by section: "§3.2" → its text and its subsections'. A
    heading without a § number ends a section at level 1 or 2 (Abstract, Facts) and
    stays inside it deeper down (the "Encoder" part of §3.1)."""
    texts: dict[str, list[str]] = {}
    current = None
    for line in paper.splitlines():
        heading = re.match(r"(#+) ", line)
        if heading:
            number = re.search(r"§([\d.]+)", line)
            if number:
                current = "§" + number.group(1).rstrip(".")
                texts.setdefault(current, [])
            elif len(heading.group(1)) <= 2:
                current = None
        elif current:
            texts.setdefault(current, []).append(line)
    return {
        s: "\n".join(
            "\n".join(lines)
            for t, lines in texts.items()
            if t == s or t.startswith(s + ".")
        )
        for s in texts
    }


def not_the_papers(quotes: list[tuple[str, str]], paper: str) -> list[str]:
    """The quotations of ``quotes`` some piece of which (split at ``[…]``) is not,
    word for word and whitespace aside, in the section of ``paper`` it cites."""
    sections = {s: squash(t) for s, t in paper_sections(paper).items()}
    return [
        f"{q} ({s})"
        for q, s in quotes
        if any(squash(p) not in sections.get(s, "") for p in q.split(GAP) if p.strip())
    ]
