"""The hosted-notebook cell's decisions, with the environment faked: nothing is installed
here. The notebook's first code cells run as a hosted kernel runs them (COLAB_RELEASE_TAG
set, no `machinery` beside the notebook): they stop with one line when no address is set,
and fetch the project from the address when one is."""

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # normally done by conftest.py
    sys.path.insert(0, str(ROOT))

import machinery  # noqa: E402

COLAB_ENV = {"COLAB_RELEASE_TAG": "release"}


def pinned(name):
    """The version requirements.txt pins for distribution ``name``."""
    return next(
        r.split("==")[1]
        for r in machinery.HOSTED_PACKAGES.values()
        if r.split("==")[0] == name
    )


def has_all_but(*missing):
    """Every package installed at its pin, except those ``missing``."""
    return lambda name: None if name in missing else pinned(name)


def test_outside_a_hosted_notebook_nothing_is_planned():
    plan = machinery.hosted_setup_plan(
        {}, {"ipykernel": object()}, has_all_but("sacrebleu", "sacremoses")
    )
    assert plan == {"hosted": False, "install": [], "found": {}}
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
    assert set(plan) == {"hosted", "install", "found"}, (
        "no figures are fetched any more"
    )
    assert plan["hosted"]
    assert sorted(plan["install"]) == [
        "sacrebleu==2.6.0",
        "sentencepiece==0.2.3",
    ]  # torch is never installed
    assert plan["found"]["sacrebleu==2.6.0"] == "not installed"
    complete = machinery.hosted_setup_plan(environ, modules, has_all_but())
    assert complete == {"hosted": True, "install": [], "found": {}}


def test_a_package_that_imports_at_another_version_than_its_pin_is_installed_again():
    versions = {"tqdm": "4.67.1", "matplotlib": pinned("matplotlib") + ".post1"}

    def version_of(name):
        return versions.get(name, pinned(name))

    plan = machinery.hosted_setup_plan(COLAB_ENV, {}, version_of)
    assert sorted(plan["install"]) == [
        f"matplotlib=={pinned('matplotlib')}",
        f"tqdm=={pinned('tqdm')}",
    ]
    assert plan["found"][f"tqdm=={pinned('tqdm')}"] == "4.67.1 installed"
    # this process's own versions are read from the installed distributions
    assert machinery.hosted.installed_version("torch") == torch.__version__
    assert machinery.hosted.installed_version("no-such-distribution-here") is None


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
    monkeypatch.setattr(machinery.hosted, "installed_version", has_all_but("tqdm"))
    machinery.hosted_setup(log=lambda *a: None)
    assert len(commands) == 1 and commands[0][-1] == "tqdm==4.70.1"


# The notebook's first code cells, as a hosted kernel runs them.

NOTEBOOK = ROOT / "the_annotated_transformer.py"


def prelude_cells() -> str:
    """The notebook's code cells (jupytext's ``# %%`` cells, markdown left out) up to
    and including the Prelude's set-up cell, the one that runs ``git clone``."""
    code, cell, setup = [], None, False
    for line in NOTEBOOK.read_text(encoding="utf-8").splitlines():
        if line.startswith("# %%"):
            if setup:
                return "\n".join(code) + "\n"
            cell = "markdown" if "[markdown]" in line else "code"
            continue
        if cell == "code":
            code.append(line)
            setup = setup or '"git", "clone"' in line
    raise AssertionError("the notebook has no set-up cell that runs git clone")


# run as a Jupyter kernel would: the notebook's code as __main__, with ipykernel loaded
DRIVER = """
import sys, types
sys.modules.setdefault("ipykernel", types.ModuleType("ipykernel"))
namespace = {"__name__": "__main__"}
exec(compile(open(sys.argv[1]).read(), "notebook cells", "exec"), namespace)
import machinery  # as Part 4 does
print("machinery from", machinery.__file__)
"""


def run_hosted(tmp_path, address=None, kernel_exists=False):
    """The first cells in ``tmp_path/kernel`` (no machinery there), COLAB_RELEASE_TAG
    set, ``ANNOTATED_TRANSFORMER_REPO`` = ``address`` when given."""
    kernel = tmp_path / "kernel"
    kernel.mkdir(exist_ok=kernel_exists)
    (tmp_path / "cells.py").write_text(prelude_cells())
    (tmp_path / "driver.py").write_text(DRIVER)
    env = {
        k: v
        for k, v in os.environ.items()
        if k
        not in ("PYTHONPATH", "ANNOTATED_TRANSFORMER_REPO", "KAGGLE_KERNEL_RUN_TYPE")
    }
    env["COLAB_RELEASE_TAG"] = "release-test"
    env["MPLBACKEND"] = "Agg"
    if address is not None:
        env["ANNOTATED_TRANSFORMER_REPO"] = address
    return subprocess.run(
        [sys.executable, str(tmp_path / "driver.py"), str(tmp_path / "cells.py")],
        cwd=kernel,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_a_hosted_notebook_without_an_address_stops_at_its_first_cell_in_one_line(
    tmp_path,
):
    proc = run_hosted(tmp_path)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()
    assert last and "ANNOTATED_TRANSFORMER_REPO" in last[-1], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and len(last) == 1, proc.stderr[-2000:]
    assert not (tmp_path / "kernel" / "annotated-transformer").exists()


def project_origin(tmp_path) -> Path:
    """A bare repository holding the project as its repository would: the package and
    the notebook."""
    source = tmp_path / "project"
    source.mkdir()
    for name in ("machinery", "the_annotated_transformer.py", "CITATION.cff"):
        subprocess.run(["cp", "-r", str(ROOT / name), str(source)], check=True)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C"]
    subprocess.run([*git, str(source), "init", "-q"], check=True)
    subprocess.run([*git, str(source), "add", "-A"], check=True)
    subprocess.run([*git, str(source), "commit", "-q", "-m", "p"], check=True)
    origin = tmp_path / "origin.git"
    clone = ["git", "clone", "-q", "--bare", str(source), str(origin)]
    subprocess.run(clone, check=True)
    return origin


def test_a_hosted_notebook_fetches_the_project_from_the_address_set(tmp_path):
    origin = project_origin(tmp_path)
    proc = run_hosted(tmp_path, address=origin.as_uri())
    assert proc.returncode == 0, proc.stderr[-3000:]
    checkout = tmp_path / "kernel" / "annotated-transformer"
    assert (checkout / "machinery" / "__init__.py").is_file()
    where = proc.stdout.strip().splitlines()[-1]
    assert where == f"machinery from {checkout / 'machinery' / '__init__.py'}", where


def test_run_again_after_a_restart_the_hosted_notebook_reuses_its_checkout(tmp_path):
    # the notebook tells users to restart the runtime and run it again: the checkout
    # of the first run is there, and is used, with no address and nothing fetched
    origin = project_origin(tmp_path)
    assert run_hosted(tmp_path, address=origin.as_uri()).returncode == 0
    subprocess.run(["rm", "-rf", str(origin)], check=True)  # nothing to fetch now
    proc = run_hosted(tmp_path, kernel_exists=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    checkout = tmp_path / "kernel" / "annotated-transformer"
    assert proc.stdout.strip().splitlines()[-1] == (
        f"machinery from {checkout / 'machinery' / '__init__.py'}"
    )


def test_an_annotated_transformer_folder_that_is_not_this_project_is_refused(tmp_path):
    (tmp_path / "kernel" / "annotated-transformer").mkdir(parents=True)
    (tmp_path / "kernel" / "annotated-transformer" / "notes.txt").write_text("mine")
    proc = run_hosted(
        tmp_path, address="https://example.invalid/x.git", kernel_exists=True
    )
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode != 0 and len(lines) == 1, proc.stderr[-2000:]
    assert "not this project" in lines[0]
    assert (
        tmp_path / "kernel" / "annotated-transformer" / "notes.txt"
    ).read_text() == "mine"


@pytest.mark.parametrize(
    "address",
    [
        "file:///nowhere/at/all.git",  # a repository that is not there
        "ext::sh -c touch% pwned",  # a transport git refuses
        "--upload-pack=touch pwned",  # an option, were it not after `--`
    ],
)
def test_a_failed_clone_is_one_line_and_an_address_is_never_an_option(
    tmp_path, address
):
    proc = run_hosted(tmp_path, address=address)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode != 0 and len(lines) == 1, proc.stderr[-2000:]
    assert lines[0].startswith("git clone ") and "failed" in lines[0], lines
    assert "Traceback" not in proc.stderr
    assert not list(tmp_path.rglob("pwned"))  # nothing ran


def test_the_notebooks_project_address_is_the_one_citation_cff_names():
    tree = ast.parse(NOTEBOOK.read_text(encoding="utf-8"))
    literal = [
        ast.literal_eval(node.value)
        for node in tree.body
        if isinstance(node, ast.Assign)
        and [getattr(t, "id", None) for t in node.targets] == ["PROJECT_URL"]
    ]
    assert literal == [machinery.project_url()], literal


@pytest.mark.parametrize("on_gpu", [False, True])
@pytest.mark.parametrize("hosted", [False, True])
@pytest.mark.parametrize("full", [False, True])
def test_part_4_trains_iwslt14_for_fewer_epochs_only_hosted_on_a_gpu(
    on_gpu, hosted, full
):
    # Part 4: "In a hosted notebook … there it trains 15 … Set
    # ANNOTATED_TRANSFORMER_FULL=1 for the full 50 epochs"; a CPU trains the sample.
    environ = (COLAB_ENV if hosted else {}) | (
        {"ANNOTATED_TRANSFORMER_FULL": "1"} if full else {}
    )
    preset, overrides = machinery.iwslt_run_choice(on_gpu, environ, {})
    assert preset == ("iwslt14-small" if on_gpu else "iwslt14-sample")
    epochs = machinery.get_config(preset, **overrides).epochs
    if on_gpu and hosted and not full:
        assert epochs == 15 < machinery.get_config(preset).epochs
    else:
        assert overrides == {}
    assert machinery.get_config("iwslt14-small").epochs == 50


def test_the_hosted_epochs_are_the_ones_part_4_names():
    text = " ".join((ROOT / "the_annotated_transformer.py").read_text().split())
    said = f"so there it trains {machinery.hosted.HOSTED_EPOCHS} (about half an hour"
    assert said in text.replace("# ", "")
