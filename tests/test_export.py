"""The inference file (`machinery.export`): a model exported and loaded back translates
as it did; every part is checked by size and SHA-256, so a changed byte or a mismatched
part is refused in one line; no pickle is in it; and the shipped model scores, on a
fixed slice of the test set and on the whole of it, what was recorded for it."""

import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import machinery
import the_annotated_transformer as tat
from machinery.export import (
    BPE,
    META,
    SHIPPED,
    WEIGHTS,
    export_model,
    folder_bytes,
    load_model,
    read_meta,
    score_model,
    write_meta,
)
from machinery.inference import translate_lines
from machinery.runfiles import CheckpointError

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "the_annotated_transformer.py"
pytestmark = pytest.mark.usefixtures("one_thread")

SENTENCES = [
    "Ein Hund rennt über eine Wiese.",
    "Zwei Männer spielen Fußball im Park.",
    "Eine Frau liest ein Buch am Strand.",
    "Ein Kind isst einen roten Apfel.",
    "Drei Hunde laufen durch den Schnee.",
    "A dog runs across a meadow.",
    "Two men play football in the park.",
    "A woman reads a book on the beach.",
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A one-layer Multi30k-shaped model with its own small BPE model, exported."""
    torch.manual_seed(0)
    subwords = tat.Subwords.train(SENTENCES * 20, 80)
    cfg = machinery.get_config(
        "multi30k-small", N=1, d_model=32, d_ff=64, h=4, device="cpu"
    )
    vocab = subwords.vocab
    model = tat.make_model(len(vocab), len(vocab), cfg).eval()
    folder = tmp_path_factory.mktemp("model")
    source = {"checkpoints": ["checkpoint-00000001.pt"], "commit": "abc", "bleu": 1.5}
    export_model(folder, model, cfg, vocab, vocab, subwords, source)
    return model, cfg, vocab, subwords, folder


def copy_of(folder: Path, tmp_path: Path) -> Path:
    """A copy of a model folder to damage."""
    out = tmp_path / "copy"
    out.mkdir()
    for part in folder.iterdir():
        (out / part.name).write_bytes(part.read_bytes())
    return out


def test_an_exported_model_loads_back_with_the_same_weights_and_translations(tiny):
    model, cfg, vocab, subwords, folder = tiny
    again, cfg2, src2, tgt2, sub2, meta = load_model(folder)
    assert dataclasses.replace(cfg2, device="cpu") == cfg  # decoded anywhere
    assert src2.itos == vocab.itos and tgt2.itos == vocab.itos
    assert sub2.model_proto == subwords.model_proto
    for name, tensor in model.state_dict().items():  # the tied ones and buffers too
        assert torch.equal(again.state_dict()[name], tensor), name
    shared = again.src_embed[0].lut.weight
    assert shared is again.generator.proj.weight  # §3.4's sharing survives the file
    lines = SENTENCES[:4]
    args = ("cpu", 4, 0.6)
    assert translate_lines(lines, again, cfg, src2, tgt2, sub2, *args) == (
        translate_lines(lines, model, cfg, vocab, vocab, subwords, *args)
    )
    assert meta["source"]["bleu"] == 1.5 and meta["decoding"]["beam_size"] == 4


def test_the_weights_are_stored_once_each_and_without_pickle(tiny):
    model, _, _, _, folder = tiny
    from safetensors import safe_open

    with safe_open(folder / WEIGHTS, framework="numpy") as f:  # safetensors alone
        names = set(f.keys())
    assert names == {n for n, _ in model.named_parameters()}  # tied: once
    assert not any(name.endswith(".pe") for name in names)  # computed again
    assert sorted(p.name for p in folder.iterdir()) == sorted([META, WEIGHTS, BPE])
    for part in folder.iterdir():
        head = part.read_bytes()[:2]
        assert head != b"\x80\x04" and head != b"PK"  # neither a pickle nor a zip
    meta = json.loads((folder / META).read_text())
    assert meta["sizes"]["parameters"] == sum(p.numel() for p in model.parameters())
    assert meta["tied"]["generator.proj.weight"] == "src_embed.0.lut.weight"


@pytest.mark.parametrize("part", [WEIGHTS, BPE, META])
def test_a_changed_byte_in_any_part_is_refused_in_one_line(tiny, tmp_path, part):
    folder = copy_of(tiny[-1], tmp_path)
    data = bytearray((folder / part).read_bytes())
    where = len(data) // 2 if part != META else data.index(b'"commit": "abc"') + 12
    data[where] ^= 0x01
    (folder / part).write_bytes(bytes(data))
    with pytest.raises(CheckpointError) as e:
        load_model(folder)
    assert "\n" not in str(e.value) and ("SHA-256" in str(e.value))


def test_a_cut_file_and_a_missing_one_are_named(tiny, tmp_path):
    folder = copy_of(tiny[-1], tmp_path)
    (folder / WEIGHTS).write_bytes((folder / WEIGHTS).read_bytes()[:-10])
    with pytest.raises(CheckpointError, match="bytes, model.json says"):
        load_model(folder)
    (folder / BPE).unlink()
    (folder / WEIGHTS).write_bytes((tiny[-1] / WEIGHTS).read_bytes())
    with pytest.raises(CheckpointError, match=f"{BPE} cannot be read"):
        load_model(folder)
    with pytest.raises(CheckpointError, match="holds no model.json"):
        load_model(tmp_path)
    with pytest.raises(CheckpointError, match="does not exist"):
        load_model(tmp_path / "nowhere")


def test_parts_of_another_model_are_refused_even_with_matching_digests(tiny, tmp_path):
    model, cfg, vocab, subwords, _ = tiny
    wider = machinery.get_config("multi30k-small", N=1, d_model=48, d_ff=64, h=4)
    other = tat.make_model(len(vocab), len(vocab), wider)
    folder = tmp_path / "m"
    export_model(folder, other, wider, vocab, vocab, subwords, {})
    meta = read_meta(folder)
    meta["config"]["d_model"] = 32  # hand-edited, the digest written again
    meta["sizes"]["d_model"] = 32
    write_meta(folder, meta)
    with pytest.raises(CheckpointError, match="it is of another model"):
        load_model(folder)
    meta["sizes"]["N"] = 6  # sizes that disagree with the config
    write_meta(folder, meta)
    with pytest.raises(CheckpointError, match=r"the sizes \(N\) disagree"):
        load_model(folder)


def test_bfloat16_storage_halves_the_weights_and_decodes_in_float32(tiny, tmp_path):
    model, cfg, vocab, subwords, folder = tiny
    narrow = tmp_path / "bf16"
    export_model(narrow, model, cfg, vocab, vocab, subwords, {}, storage="bfloat16")
    full, half = (read_meta(f)["files"][WEIGHTS]["bytes"] for f in (folder, narrow))
    assert half < 0.55 * full
    again = load_model(narrow)[0]
    weight = model.src_embed[0].lut.weight
    assert again.src_embed[0].lut.weight.dtype == torch.float32
    assert torch.equal(
        again.src_embed[0].lut.weight, weight.detach().bfloat16().float()
    )


def cli(*args, cwd, **env):
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1", **env},
        timeout=300,
    )


def test_export_then_translate_and_evaluate_with_the_folder(tmp_path):
    trained = cli(
        *("train", "--config", "copy", "--max_steps", "3", "--N", "1"),
        *("--d_model", "32", "--d_ff", "64", "--h", "4", "--run_dir", "run"),
        cwd=tmp_path,
    )
    assert trained.returncode == 0, trained.stderr
    out = cli(
        "export", "--run_dir", "run", "--out", "m", "--commit", "abc1234", cwd=tmp_path
    )
    assert out.returncode == 0, out.stderr
    bad = cli("export", "--run_dir", "run", "--commit", "HEAD~1", cwd=tmp_path)
    assert bad.returncode == 2 and len(bad.stderr.splitlines()) == 1
    assert "--commit" in bad.stderr and not (tmp_path / "models").exists()
    meta = read_meta(tmp_path / "m")
    averaged = [p.name for p in machinery.checkpoint_paths(tmp_path / "run")][-5:]
    assert meta["source"]["checkpoints"] == averaged  # the run's own average
    assert out.stdout.startswith(f"wrote m: {len(averaged)} checkpoint(s) averaged")
    assert meta["source"]["steps"] == 3 and meta["source"]["machine"]
    assert meta["source"]["commit"] == "abc1234"  # the run's, as given
    # the folder decodes as the run directory does (the same average)
    scored = {}
    for flag, where in (("--model", "m"), ("--run_dir", "run")):
        got = cli("evaluate", flag, where, "--hypotheses", f"{where}.txt", cwd=tmp_path)
        assert got.returncode == 0, got.stderr
        bleu, _, said = got.stdout.splitlines()
        hyps = (tmp_path / f"{where}.txt").read_bytes()
        assert said == (
            f"hypotheses: {where}.txt sha256 {machinery.export.sha256_of(hyps)}"
        )
        assert len(hyps.decode().splitlines()) == 100  # the copy task's test split
        scored[flag] = (bleu, hyps)
    assert scored["--model"] == scored["--run_dir"]
    damaged = tmp_path / "m" / WEIGHTS
    damaged.write_bytes(damaged.read_bytes()[:-1] + b"!")
    refused = cli("translate", "--model", "m", "1 2 3", cwd=tmp_path)
    assert refused.returncode == 2 and refused.stdout == ""
    assert len(refused.stderr.splitlines()) == 1 and "SHA-256" in refused.stderr


def test_a_hypotheses_file_that_cannot_be_written_is_one_line(tmp_path):
    got = cli(
        "evaluate",
        "--checkpoint",
        str(tmp_path / "none.pt"),
        "--hypotheses",
        str(tmp_path / "no" / "dir" / "h.txt"),
        cwd=tmp_path,
    )
    assert got.returncode == 2 and len(got.stderr.splitlines()) == 1


# The shipped model: exported from the run the README reports (models/multi30k-small).


def shipped_meta() -> dict:
    if not (SHIPPED / META).is_file():
        pytest.fail(f"no shipped model at {SHIPPED}")
    return read_meta(SHIPPED)


def test_the_shipped_model_is_small_checked_and_says_where_it_came_from():
    meta = shipped_meta()
    assert folder_bytes(SHIPPED) <= 32_000_000
    model, cfg, src, tgt, subwords, _ = load_model(SHIPPED)  # every digest checked
    assert cfg.dataset == "multi30k" and subwords is not None
    source = meta["source"]
    assert len(source["checkpoints"]) == cfg.average_last == 5
    assert re.fullmatch(r"[0-9a-f]{40}(-dirty)?", source["commit"])
    assert "EPYC" in (source.get("cpu") or source["machine"])
    recorded = json.loads((ROOT / "results" / "multi30k-small.json").read_text())
    assert source["steps"] == recorded["steps"]
    # the score the file itself was measured at, beam and greedy
    assert meta["score"]["sentences"] == recorded["test_sentences"]


def test_translate_answers_from_the_shipped_model_with_no_data_set(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    got = subprocess.run(
        ["make", "-s", "-C", str(ROOT), "translate", f"TEXT={SENTENCES[0]}"],
        capture_output=True,
        text=True,
        env={
            **os.environ,
            "DATA_MIRROR": str(tmp_path / "no-mirror"),
            "ANNOTATED_TRANSFORMER_DATA": str(data),
            "OMP_NUM_THREADS": "1",
        },
        timeout=300,
    )
    assert got.returncode == 0, got.stderr
    lines = got.stdout.strip().splitlines()
    assert len(lines) == 1 and "dog" in lines[-1].lower()
    assert not list(data.iterdir()) and not (tmp_path / "no-mirror").exists()


@pytest.fixture
def threads_as_scored():
    """The number of threads the shipped model was scored with (sums of floats may
    round otherwise with another number)."""
    before = torch.get_num_threads()
    torch.set_num_threads(shipped_meta()["score"]["threads"])
    yield
    torch.set_num_threads(before)


def test_the_shipped_model_scores_the_recorded_figure_on_a_fixed_slice(
    mirror, threads_as_scored
):
    meta = shipped_meta()
    piece = meta["score"]["slice"]
    model, cfg, src_vocab, tgt_vocab, subwords, _ = load_model(SHIPPED)
    import argparse

    args = argparse.Namespace(
        src=None, ref=None, split="test", first=piece["first"], data_mirror=str(mirror)
    )
    lines, refs = machinery.inference.evaluation_pairs(args, cfg)
    hyps, _ = translate_lines(
        lines, model, cfg, src_vocab, tgt_vocab, subwords, "cpu", 4, 0.6
    )
    result = tat.bleu(hyps, refs, machinery.CORPORA["multi30k"])
    assert result.score == piece["bleu"]
    assert (
        machinery.export.sha256_of(machinery.inference.hypotheses_text(hyps))
        == (piece["hypotheses_sha256"])
    )


def test_the_shipped_model_reproduces_the_readme_bleu_to_every_digit(
    mirror, threads_as_scored
):
    # slow: the whole test split, beam and greedy (skipped without the data set)
    meta = shipped_meta()
    score = score_model(SHIPPED, meta["score"]["slice"]["first"], str(mirror), print)
    assert score == meta["score"] | {"machine": score["machine"]}
    readme = (ROOT / "README.md").read_text()
    row = f"{score['bleu']:.2f} / {score['greedy']['bleu']:.2f}"
    assert "| `multi30k-small` |" in readme and row in readme


def test_part_4_loads_the_shipped_model_from_any_working_directory(
    tmp_path, monkeypatch
):
    # a hosted kernel or a clone with no runs: the shipped model stands in
    meta = shipped_meta()
    monkeypatch.chdir(tmp_path)
    cfg = machinery.get_config("multi30k-small", run_dir=str(tmp_path / "runs" / "m"))
    said = []
    summary = machinery.run_or_load(cfg, log=said.append)
    assert said == [
        f"loaded the model {SHIPPED} ({machinery.export.score_line(meta)}); no run here"
    ]
    assert summary["bleu"] == meta["score"]["bleu"]
    assert machinery.runs.trained_model(summary).where == f"the model {SHIPPED}"


def test_the_stored_part_4_outputs_name_no_folder_a_clone_lacks():
    cells = json.loads((ROOT / "annotated_transformer.ipynb").read_text())["cells"]
    start = next(i for i, c in enumerate(cells) if "# Part 4" in "".join(c["source"]))
    text = "\n".join(
        "".join(out.get("text", ""))
        + "".join(out.get("data", {}).get("text/plain", ""))
        for cell in cells[start:]
        for out in cell.get("outputs", [])
    )
    trained_here = re.findall(r"training here, into (\S+)", text)
    for folder in re.findall(r"runs/[\w./-]*\w", text):
        assert any(folder.startswith(made) for made in trained_here), folder
    assert "loaded the model models/multi30k-small (" in text
    assert "maps from the model models/multi30k-small" in text
