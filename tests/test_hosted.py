"""The hosted-notebook cell's decisions, with the environment faked: nothing is installed here."""

import re
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # normally done by conftest.py
    sys.path.insert(0, str(ROOT))

import machinery  # noqa: E402

COLAB_ENV = {"COLAB_RELEASE_TAG": "release"}


def has_all_but(*missing):
    return lambda name: name not in missing


def test_outside_a_hosted_notebook_nothing_is_planned():
    plan = machinery.hosted_setup_plan(
        {}, {"ipykernel": object()}, has_all_but("sacrebleu", "seaborn")
    )
    assert plan == {"hosted": False, "install": []}
    assert not machinery.is_hosted({}, {"ipykernel": object()})


@pytest.mark.parametrize(
    "environ, modules",
    [
        (COLAB_ENV, {}),
        ({}, {"google.colab": object()}),
        ({"KAGGLE_KERNEL_RUN_TYPE": "Interactive"}, {}),
    ],
)
def test_a_hosted_notebook_installs_only_what_is_missing(environ, modules):
    assert machinery.is_hosted(environ, modules)
    plan = machinery.hosted_setup_plan(
        environ, modules, has_all_but("sacrebleu", "sentencepiece", "torch")
    )
    assert set(plan) == {"hosted", "install"}, "no figures are fetched any more"
    assert plan["hosted"]
    assert sorted(plan["install"]) == [
        "sacrebleu==2.6.0",
        "sentencepiece==0.2.3",
    ]  # torch is never installed
    complete = machinery.hosted_setup_plan(environ, modules, has_all_but())
    assert complete == {"hosted": True, "install": []}


def test_the_pins_are_those_of_requirements_txt():
    pinned = dict(
        re.findall(
            r"^([A-Za-z0-9_.-]+)==(\S+)", (ROOT / "requirements.txt").read_text(), re.M
        )
    )
    for requirement in machinery.HOSTED_PACKAGES.values():
        name, version = requirement.split("==")
        assert pinned.get(name) == version, requirement
    assert "torch" not in machinery.HOSTED_PACKAGES


def test_carrying_out_a_plan_keeps_the_installed_torch(monkeypatch):
    import subprocess

    commands = []

    def fake_run(cmd, check=False):
        constraint = Path(cmd[cmd.index("-c") + 1]).read_text()
        commands.append((cmd, constraint))

    monkeypatch.setattr(subprocess, "run", fake_run)
    machinery.hosted_setup(
        {"hosted": True, "install": ["sacrebleu==2.6.0"]}, log=lambda *a: None
    )
    ((cmd, constraint),) = commands
    assert (
        cmd[:4] == [sys.executable, "-m", "pip", "install"]
        and cmd[-1] == "sacrebleu==2.6.0"
    )
    assert constraint.strip() == f"torch=={torch.__version__}"


def test_a_complete_plan_runs_nothing(monkeypatch):
    import subprocess

    commands = []
    monkeypatch.setattr(
        subprocess, "run", lambda cmd, check=False: commands.append(cmd)
    )
    machinery.hosted_setup({"hosted": True, "install": []}, log=lambda *a: None)
    machinery.hosted_setup({"hosted": False, "install": []}, log=lambda *a: None)
    assert commands == []


def test_without_a_plan_it_plans_for_this_process_and_a_colab_one_installs(monkeypatch):
    import subprocess

    commands = []
    monkeypatch.setattr(
        subprocess, "run", lambda cmd, check=False: commands.append(cmd)
    )
    for name in ("COLAB_RELEASE_TAG", "KAGGLE_KERNEL_RUN_TYPE"):
        monkeypatch.delenv(name, raising=False)
    machinery.hosted_setup(log=lambda *a: None)  # not hosted: nothing
    assert commands == []
    monkeypatch.setenv("COLAB_RELEASE_TAG", "test")
    monkeypatch.setattr(machinery.hosted, "importable", lambda name: name != "tqdm")
    machinery.hosted_setup(log=lambda *a: None)
    assert len(commands) == 1 and commands[0][-1] == "tqdm==4.70.1"
