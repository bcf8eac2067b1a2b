"""The hosted-notebook cell's decisions, with the environment faked: nothing is installed or fetched here."""
import re
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # normally done by conftest.py
    sys.path.insert(0, str(ROOT))

import the_annotated_transformer as tat  # noqa: E402

SOURCE = "https://example.invalid/repo/raw"
COLAB_ENV = {"COLAB_RELEASE_TAG": "release"}


def has_all_but(*missing):
    return lambda name: name not in missing


def test_outside_a_hosted_notebook_nothing_is_planned(tmp_path):
    plan = tat.hosted_setup_plan({}, {"ipykernel": object()}, has_all_but("sacrebleu", "seaborn"), tmp_path, SOURCE)
    assert plan == {"hosted": False, "install": [], "fetch": []}


@pytest.mark.parametrize("environ, modules", [
    (COLAB_ENV, {}), ({}, {"google.colab": object()}), ({"KAGGLE_KERNEL_RUN_TYPE": "Interactive"}, {}),
])
def test_a_hosted_notebook_installs_only_what_is_missing_and_fetches_only_absent_files(tmp_path, environ, modules):
    (tmp_path / "figures").mkdir()
    (tmp_path / "figures" / "figure1_transformer.png").write_bytes(b"png")
    plan = tat.hosted_setup_plan(environ, modules, has_all_but("sacrebleu", "sentencepiece", "torch"), tmp_path,
                                 SOURCE + "/")
    assert plan["hosted"]
    assert sorted(plan["install"]) == ["sacrebleu==2.6.0", "sentencepiece==0.2.3"]  # torch is never installed
    assert plan["fetch"] == [(f"{SOURCE}/figures/figure2_attention.png", tmp_path / "figures" / "figure2_attention.png")]
    complete = tat.hosted_setup_plan(environ, modules, has_all_but(), tmp_path / "nothing-here", "")
    assert complete["install"] == [] and complete["fetch"] == [], "no source given: nothing to fetch from"


def test_the_pins_are_those_of_requirements_txt():
    pinned = dict(re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)", (ROOT / "requirements.txt").read_text(), re.M))
    for requirement in tat.HOSTED_PACKAGES.values():
        name, version = requirement.split("==")
        assert pinned.get(name) == version, requirement
    assert "torch" not in tat.HOSTED_PACKAGES


def test_carrying_out_a_plan_keeps_the_installed_torch(tmp_path, monkeypatch):
    import subprocess
    import urllib.request

    commands, downloads = [], []

    def fake_run(cmd, check=False):
        constraint = Path(cmd[cmd.index("-c") + 1]).read_text()
        commands.append((cmd, constraint))

    monkeypatch.setattr(subprocess, "run", fake_run)
    monkeypatch.setattr(urllib.request, "urlretrieve", lambda url, path: downloads.append((url, Path(path))))
    target = tmp_path / "figures" / "figure2_attention.png"
    tat.hosted_setup({"hosted": True, "install": ["sacrebleu==2.6.0"], "fetch": [("u", target)]}, log=lambda *a: None)
    (cmd, constraint), = commands
    assert cmd[:4] == [sys.executable, "-m", "pip", "install"] and cmd[-1] == "sacrebleu==2.6.0"
    assert constraint.strip() == f"torch=={torch.__version__}"
    assert downloads == [("u", target)] and target.parent.is_dir()
