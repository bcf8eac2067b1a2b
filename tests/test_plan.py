"""The plan a run is checked against before any work (`planning.py`), the checks of
what checkpoints and caches carry (`runfiles.py`), and the environment of several
processes (`cli.py`): each invariant on its own."""

import dataclasses
import json

import pytest
import torch

import machinery
from machinery.cli import environment_problem
from machinery.datafiles import file_problem
from machinery.parts import notebook
from machinery.planning import LossWatch, memory_estimate, parameter_count
from machinery.runfiles import finished_run_problem, read_verified, write_with_digest


@pytest.mark.parametrize(
    "overrides, vocabs",
    [
        ({}, (14, 14)),
        ({"tie_weights": False}, (14, 20)),
        ({"tie_weights": False, "shared_vocab": False}, (30, 20)),
        (
            {"d_k": 16, "N_dec": 3, "norm_first": True, "positional": "learned"},
            (14, 14),
        ),
    ],
)
def test_the_parameter_count_is_the_models_without_building_it(overrides, vocabs):
    cfg = machinery.get_config("copy", **overrides)
    model = notebook().make_model(*vocabs, cfg)
    assert parameter_count(cfg, *vocabs) == notebook().count_parameters(model)


def test_the_estimate_grows_with_the_model_and_the_batch():
    cfg = machinery.get_config("iwslt14-small")
    base, weights, activations = memory_estimate(cfg, 10_000, 10_000, 102)
    assert base == weights + activations and weights == 16 * parameter_count(
        cfg, 10_000, 10_000
    )
    assert base < 8 * 2**30  # the GPU preset is not refused on an ordinary machine
    deeper = dataclasses.replace(cfg, N=12)
    assert memory_estimate(deeper, 10_000, 10_000, 102)[0] > base
    bigger_batch = dataclasses.replace(cfg, batch_tokens=8192)
    assert memory_estimate(bigger_batch, 10_000, 10_000, 102)[2] > activations


def test_a_loss_far_above_a_uniform_guess_stops_only_after_several_updates():
    watch = LossWatch(vocab=1000, patience=3)
    high = 3.5 * 6.91  # above 3 × ln 1000
    assert watch.problem(high) is None and watch.problem(high) is None
    assert watch.problem(5.0) is None  # a plausible loss resets the count
    assert watch.problem(high) is None and watch.problem(high) is None
    line = watch.problem(high)
    assert "exploded" in line and "--lr_factor" in line and "--warmup" in line


@pytest.mark.parametrize(
    "environ, words",
    [
        ({"WORLD_SIZE": "2", "RANK": "2"}, "RANK=2"),
        ({"WORLD_SIZE": "0"}, "WORLD_SIZE=0"),
        ({"WORLD_SIZE": "2"}, "without RANK"),
        ({"LOCAL_WORLD_SIZE": "1", "LOCAL_RANK": "1"}, "LOCAL_RANK=1"),
        ({"MASTER_PORT": "80a"}, "MASTER_PORT"),
        ({"MASTER_PORT": "70000"}, "MASTER_PORT"),
    ],
)
def test_process_variables_that_do_not_fit_are_named(environ, words):
    assert words in (environment_problem(environ) or "")


def test_process_variables_that_fit_pass():
    assert environment_problem({}) is None
    ok = {"WORLD_SIZE": "2", "RANK": "1", "MASTER_PORT": "29500"}
    assert environment_problem(ok) is None


def test_a_data_file_that_cannot_be_read_says_why(tmp_path):
    (tmp_path / "file").write_text("a\n")
    (tmp_path / "dir").mkdir()
    (tmp_path / "loop").symlink_to(tmp_path / "loop2")
    (tmp_path / "loop2").symlink_to(tmp_path / "loop")
    (tmp_path / "broken").symlink_to(tmp_path / "nowhere")
    assert file_problem(tmp_path / "file") is None
    assert file_problem(tmp_path / "dir") == "is a directory, not a file"
    assert file_problem(tmp_path / "loop") == "is a symbolic link loop"
    assert file_problem(tmp_path / "broken") == "is a broken symbolic link"
    assert file_problem(tmp_path / "none") == "is missing"


def test_a_cache_is_checked_against_the_digest_beside_it(tmp_path):
    path = tmp_path / "bpe-x.model"
    write_with_digest(path, b"model bytes")
    assert read_verified(path) == b"model bytes"
    path.write_bytes(b"model")
    with pytest.raises(ValueError, match="SHA-256"):
        read_verified(path)


def test_a_finished_run_is_kept_from_other_settings_only(tmp_path):
    cfg = machinery.get_config("copy", run_dir=str(tmp_path))
    results = {"config": json.loads(json.dumps(dataclasses.asdict(cfg)))}
    (tmp_path / "results.json").write_text(json.dumps(results))
    assert finished_run_problem(tmp_path, cfg) is None
    elsewhere = dataclasses.replace(cfg, eval_batch_size=7, keep_checkpoints=9)
    assert finished_run_problem(tmp_path, elsewhere) is None  # same result
    other = dataclasses.replace(cfg, max_eval_sentences=2)
    assert "max_eval_sentences=0" in finished_run_problem(tmp_path, other)


def test_a_vocabulary_below_10_symbols_is_refused_and_10_is_enough():
    # the README: "a vocabulary of at least 10 symbols", the four specials included
    from machinery.planning import VOCAB_FLOOR, PlanError, check_plan

    cfg = machinery.get_config("copy", device="cpu")
    assert VOCAB_FLOOR == 10
    for symbols in (9, 10):  # make_copy_data's vocabulary: vocab_size + 3 symbols
        data = machinery.make_copy_data(cfg, vocab_size=symbols - 3, sizes=(20, 4, 4))
        assert len(data.src_vocab) == len(data.tgt_vocab) == symbols
        if symbols < 10:
            with pytest.raises(PlanError, match=f"only {symbols} symbols"):
                check_plan(cfg, data, torch.device("cpu"), 1)
        else:
            check_plan(cfg, data, torch.device("cpu"), 1)


def test_a_run_checkpoints_every_10_minutes_unless_told():
    # the README: a crash costs at most the work since the last checkpoint, "every
    # epoch and every 10 minutes"
    assert machinery.Config().checkpoint_minutes == 10
    assert all(c.checkpoint_minutes == 10 for c in machinery.PRESETS.values())


def test_every_preset_is_post_norm_and_none_compiles():
    # the notebook: "Every preset uses post-norm"; the README: no preset turns on
    # `compile`; the paper's models use none of our departures
    for name, cfg in machinery.PRESETS.items():
        assert not cfg.norm_first and not cfg.compile, name
    for name in ("base", "big"):
        cfg = machinery.get_config(name)
        departures = (cfg.ffn_dropout, cfg.attn_dropout, cfg.N_dec, cfg.norm_first)
        assert departures == (0.0, 0.0, 0, False), name


def fake_cgroup(tmp_path, files: dict, own: str = "0::/job\n"):
    """A cgroup tree under tmp_path with ``files`` (relative path → text) and a
    /proc/self/cgroup that places this process in ``own``."""
    root = tmp_path / "cgroup"
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    root.mkdir(exist_ok=True)
    (tmp_path / "self-cgroup").write_text(own)
    return str(root), str(tmp_path / "self-cgroup")


def test_a_cgroup_v2_limit_leaves_its_limit_less_what_it_uses_beyond_page_cache(
    tmp_path,
):
    from machinery.planning import available_memory, cgroup_memory_left

    gib = 2**30
    root, own = fake_cgroup(
        tmp_path,
        {
            "job/memory.max": f"{2 * gib}\n",
            "job/memory.current": f"{gib}\n",
            "job/memory.stat": f"anon 1\ninactive_file {gib // 2}\nactive_file 9\n",
        },
    )
    assert cgroup_memory_left(root, own) == 2 * gib - gib // 2
    have, where = available_memory(torch.device("cpu"), root, own)
    assert have == 2 * gib - gib // 2 and "cgroup" in where


def test_the_tightest_cgroup_limit_counts_the_ones_above_included(tmp_path):
    from machinery.planning import cgroup_memory_left

    root, own = fake_cgroup(
        tmp_path,
        {
            "memory.max": "max\n",
            "slice/memory.max": "1000\n",
            "slice/job/memory.max": "5000\n",
            "slice/job/memory.current": "100\n",
        },
        own="0::/slice/job\n",
    )
    assert cgroup_memory_left(root, own) == 1000


def test_a_cgroup_v1_limit_is_read_and_no_limit_means_none(tmp_path):
    from machinery.planning import cgroup_memory_left

    root, own = fake_cgroup(
        tmp_path,
        {
            "memory/docker/memory.limit_in_bytes": "3000000\n",
            "memory/docker/memory.usage_in_bytes": "1000000\n",
            "memory/docker/memory.stat": "total_inactive_file 500000\n",
        },
        own="4:memory:/docker\n1:cpu:/\n",
    )
    assert cgroup_memory_left(root, own) == 3000000 - 500000
    unlimited, own = fake_cgroup(
        tmp_path / "other",
        {"memory.max": "max\n", "memory/memory.limit_in_bytes": f"{2**63 - 4096}\n"},
    )
    assert cgroup_memory_left(unlimited, own) is None


def test_a_run_that_does_not_fit_its_containers_limit_is_refused(tmp_path, monkeypatch):
    import functools

    from machinery import planning

    root, own = fake_cgroup(tmp_path, {"job/memory.max": f"{2**20}\n"})
    monkeypatch.setattr(
        planning,
        "available_memory",
        functools.partial(planning.available_memory, cgroup_root=root, cgroup_file=own),
    )
    cfg = machinery.get_config("copy", device="cpu")
    data = machinery.make_copy_data(cfg, vocab_size=11, sizes=(20, 4, 4))
    with pytest.raises(planning.PlanError, match="cannot fit.*cgroup"):
        planning.check_plan(cfg, data, torch.device("cpu"), 1)
