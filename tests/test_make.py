"""What the Makefile runs for `make lab`, `make notebook` and `make train`, read from
`make -n` and, for some, run."""

import os
import shutil
import subprocess
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(
    shutil.which("make") is None, reason="make is not installed"
)


def recipe(target: str, *variables: str) -> list[str]:
    """The commands ``make -n target`` would run, continuation lines joined."""
    out = subprocess.run(
        ["make", "-n", "--no-print-directory", target, *variables],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return out.replace("\\\n", " ").splitlines()


def lab_command(*variables: str) -> str:
    return next(line for line in recipe("lab", *variables) if "jupyter lab" in line)


def test_lab_allows_root_as_root_and_only_then():
    assert "--allow-root" in lab_command("USER_ID=0")
    assert "--allow-root" not in lab_command("USER_ID=1000")
    assert ("--allow-root" in lab_command()) == (os.getuid() == 0)


@pytest.mark.skipif(
    not (ROOT / ".venv" / "bin" / "jupyter").exists(), reason="no .venv (make install)"
)
def test_notebook_target_stores_outputs_without_execution_timestamps(tmp_path):
    nb_path = tmp_path / "small.ipynb"
    nb = nbformat.v4.new_notebook(
        cells=[
            nbformat.v4.new_markdown_cell("Two cells."),
            nbformat.v4.new_code_cell("print(6 * 7)"),
            nbformat.v4.new_code_cell("x = 1"),
        ]
    )
    nb.cells[2].metadata["execution"] = {
        "iopub.status.busy": "2026-01-01T00:00:00Z"
    }  # left by an earlier run
    nb.metadata["kernelspec"] = {
        "name": "python3",
        "display_name": "Python 3",
        "language": "python",
    }
    nbformat.write(nb, nb_path)
    commands = [
        c
        for c in recipe("notebook", f"NB={nb_path}", f"SRC={tmp_path / 'small.py'}")
        if "nbconvert" in c or "nbformat" in c
    ]
    assert len(commands) == 2  # execute, then strip
    for command in commands:
        subprocess.run(
            ["bash", "-c", command],
            cwd=ROOT,
            check=True,
            capture_output=True,
            timeout=300,
        )
    ran = nbformat.read(nb_path, as_version=4)
    assert ran.cells[1].outputs[0]["text"] == "42\n"
    assert [c.metadata.get("execution") for c in ran.cells] == [None, None, None]


def test_make_runs_everything_with_the_allocator_settings_the_machinery_records():
    """Every recipe gets glibc's keep-freed-memory settings, the values of
    machinery.GLIBC_MALLOC_SETTINGS."""
    import sys

    sys.path.insert(0, str(ROOT))
    import machinery

    settings = machinery.GLIBC_MALLOC_SETTINGS
    env = {k: v for k, v in os.environ.items() if k not in settings}
    out = subprocess.run(
        ["make", "-n", "--no-print-directory", "-p", "help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        env=env,
    ).stdout
    exported = dict(
        line.split(" = ", 1)
        for line in out.splitlines()
        if line.split(" = ", 1)[0] in settings and " = " in line
    )
    assert exported == dict(settings)
    # exported, so the programs make starts see them
    shown = subprocess.run(
        ["make", "--no-print-directory", "-s", "-f", "-", "show"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=env,
        input="include Makefile\nshow:\n"
        "\t@printenv MALLOC_MMAP_MAX_ MALLOC_TRIM_THRESHOLD_\n",
    )
    assert shown.stdout.split() == list(settings.values()), shown.stderr


@pytest.mark.skipif(
    not (ROOT / ".venv" / "bin" / "python").exists(), reason="no .venv (make install)"
)
def test_make_train_defaults_to_the_machinerys_preset_and_can_be_told_another():
    import sys

    sys.path.insert(0, str(ROOT))
    import machinery

    [command] = [line for line in recipe("train") if " train --config " in line]
    assert command.split()[1:4] == ["the_annotated_transformer.py", "train", "--config"]
    assert command.split()[4] == machinery.default_preset()
    [command] = [
        line
        for line in recipe("train", "CONFIG=copy", "ARGS=--max_steps 3")
        if " train --config " in line
    ]
    assert command.split()[4:] == ["copy", "--max_steps", "3"]


def test_no_recipe_compiles_anything():
    """No compiled kernel any more: installing, testing, training, the notebook and the
    bench run Python only."""
    for target in ("install", "test", "train", "notebook", "bench"):
        commands = " ".join(recipe(target, "CC=/no/such/compiler"))
        assert "/no/such/compiler" not in commands and ".so" not in commands, target
    gone = subprocess.run(
        ["make", "-n", "--no-print-directory", "kernel"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert gone.returncode != 0 and "No rule to make target 'kernel'" in gone.stderr
    help_text = subprocess.run(
        ["make", "--no-print-directory", "help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "make train" in help_text and "kernel" not in help_text


def test_make_runs_everything_waiting_passively_unless_the_user_set_a_policy():
    """Every recipe gets OMP_WAIT_POLICY=machinery.devices.WAIT_POLICY; a policy
    already in the environment is the one the programs get."""
    import sys

    sys.path.insert(0, str(ROOT))
    from machinery.devices import WAIT_POLICY

    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}

    def shown(environ) -> str:
        return subprocess.run(
            ["make", "--no-print-directory", "-s", "-f", "-", "show"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            env=environ,
            input="include Makefile\nshow:\n\t@printenv OMP_WAIT_POLICY\n",
        ).stdout.strip()

    assert shown(env) == WAIT_POLICY == "PASSIVE"
    assert shown({**env, "OMP_WAIT_POLICY": "ACTIVE"}) == "ACTIVE"
