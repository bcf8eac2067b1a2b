"""`make bench` in its smallest mode: every section is written, numbers are sane, checks
agree.

No timing is asserted (CI machines vary); only that the benchmark runs and reports.
"""

import json
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "bench.py"
SECTIONS = ("machine", "training", "flops", "padding", "decoding", "scaling", "beside")


def positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    """Run ``bench.py --smoke`` once (on Multi30k from the mirror if there is one, else
    the copy task)."""
    out = tmp_path_factory.mktemp("bench")
    mirror = Path(os.environ.get("DATA_MIRROR") or ROOT.parent / "shared" / "data")
    args = ["--smoke", "--quiet", "--threads", "1", "--out", str(out)]
    env = {**os.environ, "ANNOTATED_TRANSFORMER_DATA": str(out / "data")}
    if (mirror / "multi30k").is_dir():
        env["DATA_MIRROR"] = str(mirror)
    else:
        args += ["--dataset", "copy"]
    result = subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        cwd=out,
        capture_output=True,
        text=True,
        env=env,
        timeout=900,  # ten policy processes in the smoke run
    )
    assert result.returncode == 0, result.stderr
    return {
        "json": json.loads((out / "bench.json").read_text()),
        "stdout": result.stdout,
        "out": out,
    }


def test_only_beside_measures_the_wait_policies_alone(tmp_path):
    """``--only beside``: section 6 by itself, in ``beside.json`` (no ``bench.json``),
    its table printed."""
    args = ["--smoke", "--quiet", "--threads", "1", "--dataset", "copy", "--only"]
    result = subprocess.run(
        [sys.executable, str(SCRIPT), *args, "beside", "--out", str(tmp_path)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={**os.environ, "ANNOTATED_TRANSFORMER_DATA": str(tmp_path / "data")},
        timeout=900,
    )
    assert result.returncode == 0, result.stderr
    data = json.loads((tmp_path / "beside.json").read_text())
    assert {"machine", "beside"} <= set(data) and "training" not in data
    assert not (tmp_path / "bench.json").exists()
    assert "| PASSIVE" in result.stdout and "beside.json" in result.stdout


def test_every_section_is_written_with_the_machine_and_command(report):
    data = report["json"]
    for section in SECTIONS:
        assert section in data, section
    assert data["machine"]["cpu"] and data["machine"]["cores"] >= 1
    assert isinstance(data["machine"]["bf16_native"], bool)
    assert "--smoke" in data["command"]
    assert (
        data["machine"]["cpu"] in report["stdout"]
        and "| measurement | value | goal |" in report["stdout"]
    )
    # how freed memory was reused: glibc's settings, or that another C library ran it
    assert (
        data["machine"]["allocator"].startswith("memory: ")
        or data["machine"]["allocator"] == "not glibc"
    )


def test_training_rows_cover_every_model_and_the_native_precisions(report):
    tr = report["json"]["training"]
    expected = ["float32"] + (
        ["bf16"] if report["json"]["machine"]["bf16_native"] else []
    )
    assert tr["precisions"] == expected
    assert {(r["model"], r["precision"]) for r in tr["results"]} == {
        (m, p) for m in ("fast", "readable", "torch") for p in expected
    }
    for r in tr["results"]:
        assert (
            positive(r["tokens_per_s"])
            and positive(r["step_s"])
            and positive(r["flops_per_s"])
        )
        assert r["best_tokens_per_s"] >= r["tokens_per_s"]
    for prec in expected:
        assert positive(tr["ratios"][prec]["fast_vs_torch"]) and positive(
            tr["ratios"][prec]["fast_vs_torch_best"]
        )
        fastest = max(
            (r for r in tr["results"] if r["precision"] == prec),
            key=lambda r: r["tokens_per_s"],
        )
        assert tr["fastest"][prec] == fastest["model"]
        # the fastest of the rows `attention` (and `compile`, off here) choose among
        paths = [
            r
            for r in tr["results"]
            if r["precision"] == prec and r["model"] in ("fast", "readable")
        ]
        assert (
            tr["fastest_path"][prec]
            == max(paths, key=lambda r: r["tokens_per_s"])["model"]
        )
    # the row of the path the preset would train with on this machine is marked
    assert tr["preset_path"] in ("fast", "readable")
    assert {r["model"] for r in tr["results"] if r["preset_choice"]} == {
        tr["preset_path"]
    }


def test_pass_by_pass_ratios_pair_passes_of_the_same_repeat(report):
    tr = report["json"]["training"]
    times = {(r["model"], r["precision"]): r["pass_times_s"] for r in tr["results"]}
    for prec in tr["precisions"]:
        for kind in ("fast", "readable"):
            p = tr["ratios"][prec][f"{kind}_vs_torch_paired"]
            per_pass = sorted(
                t / o for t, o in zip(times[("torch", prec)], times[(kind, prec)])
            )
            assert p["passes"] == tr["repeats"] == len(per_pass)
            assert p["q1"] <= p["median"] <= p["q3"]
            assert per_pass[0] <= p["q1"] + 1e-12 and p["q3"] <= per_pass[-1] + 1e-12
            assert p["median"] == pytest.approx(statistics.median(per_pass))
        for which in ("fastest", "fastest_path"):
            p = tr["preset_vs_fastest"][prec][which]
            if tr[which][prec] == tr["preset_path"]:
                assert p["q1"] == p["median"] == p["q3"] == 1.0
            else:  # the preset's row against a faster one, pass by pass
                fast, preset = (
                    times[(tr[which][prec], prec)],
                    times[(tr["preset_path"], prec)],
                )
                assert p["median"] == pytest.approx(
                    statistics.median(f / t for f, t in zip(fast, preset))
                )


def test_flop_shares_are_positive_and_use_the_measured_peaks(report):
    fl = report["json"]["flops"]
    assert set(fl["peak_flops_per_s"]) == set(report["json"]["training"]["precisions"])
    assert all(positive(p) for p in fl["peak_flops_per_s"].values())
    for r in fl["results"]:
        assert positive(r["share_of_peak"])
        assert r["share_of_peak"] == pytest.approx(
            r["flops_per_s"] / fl["peak_flops_per_s"][r["precision"]]
        )


def test_padding_shares_are_fractions_and_bucketing_pads_less(report):
    pad = report["json"]["padding"]
    assert 0 <= pad["bucketed_share"] < 1 and 0 < pad["fixed_share"] < 1
    assert pad["bucketed_share"] < pad["fixed_share"]


def test_decoders_that_must_agree_do_agree(report):
    dec = report["json"]["decoding"]
    assert "random weights" in dec["model"]
    assert "batched_full_vs_single" in dec["checks"]
    for name, check in dec["checks"].items():
        assert check["of"] > 0 and check["all_same"], (name, check)
    available = [r for r in dec["results"] if r["available"]]
    assert len(available) >= 2
    for r in available:
        assert positive(r["sentences_per_s"]) and positive(r["speedup_vs_single"])
    for r in dec["results"]:
        if not r["available"]:
            assert "not available" in r["note"]


def test_scaling_covers_every_length_for_both_sublayers(report):
    sc = report["json"]["scaling"]
    got = {(r["sublayer"], r["d_model"], r["length"]) for r in sc["results"]}
    assert got == {
        (s, d, n)
        for s in ("self-attention", "feed-forward")
        for d in sc["d_models"]
        for n in sc["lengths"]
    }
    assert all(positive(r["ms"]) for r in sc["results"])


def test_the_plot_is_a_png(report):
    png = report["out"] / "bench.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_written_out_softmax_is_the_softmax_and_its_backward_is_autograds(
    monkeypatch,
):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import softmax_rows
    import torch

    torch.manual_seed(0)
    for n in (3, 12, 24):
        x = (torch.randn(5, 8, n, n) * 3).requires_grad_()
        g = torch.randn(5, 8, n, n)
        y = torch.softmax(x, -1)
        (expected,) = torch.autograd.grad(y, x, g)
        torch.testing.assert_close(
            softmax_rows.written_out(x.detach()), y.detach(), rtol=0, atol=1e-6
        )
        torch.testing.assert_close(
            softmax_rows.written_out_backward(g, y.detach()),
            expected,
            rtol=0,
            atol=1e-6,
        )


def test_softmax_rows_prints_one_row_of_sane_numbers_per_length():
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "softmax_rows.py"),
            "--lengths",
            "4,20",
            "--elements",
            "4096",
            "--repeats",
            "3",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    rows = [
        line.strip("|").split("|")
        for line in result.stdout.splitlines()
        if line.startswith("| ")
    ]
    rows = [[cell.strip() for cell in row] for row in rows if row[0].strip().isdigit()]
    assert [row[0] for row in rows] == ["4", "20"]
    for row in rows:
        assert all(positive(float(ms)) for ms in row[2:6])
        assert 0 <= float(row[6]) <= 1e-6


def test_attention_variants_build_the_rows_they_name_and_refuse_others(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import attention_variants as av
    import machinery
    import the_annotated_transformer as tat

    cfg = machinery.get_config("tiny")
    kinds = {
        "fused-projections": av.FusedProjectionsAttention,
        "readable/short-softmax": av.ShortSoftmaxAttention,
        "readable": tat.MultiHeadedAttention,
        "fast": tat.FastMultiHeadedAttention,
    }
    for kind, cls in kinds.items():
        model = av.build(kind, 11, 11, cfg)
        assert {
            type(m) for m in model.modules() if isinstance(m, tat.MultiHeadedAttention)
        } == {cls}
    assert isinstance(av.build("torch", 11, 11, cfg), av.bench.TorchTransformer)
    for removed in (
        "readable/short_softmax",
        "readable/FastDropout",
        "readable/scatter-loss",
    ):
        with pytest.raises(ValueError, match="unknown row"):
            av.build(removed, 11, 11, cfg)


def test_attention_with_the_written_out_softmax_is_eq1_values_and_gradients(
    monkeypatch,
):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import attention_variants as av
    import the_annotated_transformer as tat
    import torch

    torch.manual_seed(0)
    q, k, v = (
        torch.randn(2, 4, 7, 8, requires_grad=True) for _ in range(3)
    )  # (batch, h, len, d_k)
    mask = torch.ones(2, 1, 7, 7, dtype=torch.bool)
    mask[1, ..., 5:] = False  # padding keys
    mask[1, :, 3, :] = False  # a row with nothing to attend to
    ours = av.attention_short_softmax(q, k, v, mask)
    eq1 = tat.attention(q, k, v, mask)[0]
    torch.testing.assert_close(ours, eq1, rtol=0, atol=1e-6)
    g = torch.randn_like(eq1)
    for a, b in zip(
        torch.autograd.grad(ours, (q, k, v), g), torch.autograd.grad(eq1, (q, k, v), g)
    ):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def test_profile_step_profiles_the_preset_as_it_was(tmp_path):
    mirror = Path(os.environ.get("DATA_MIRROR") or ROOT.parent / "shared" / "data")
    if not (mirror / "multi30k").is_dir():
        pytest.skip("profile_step.py needs the Multi30k data")
    env = {
        **os.environ,
        "DATA_MIRROR": str(mirror),
        "ANNOTATED_TRANSFORMER_DATA": str(tmp_path),
    }
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "profile_step.py"),
            "--config",
            "tiny",
            "--steps",
            "1",
            "--top",
            "3",
            "--paths",
            "fast",
            "--adam",
            "per-tensor",
            "--categories",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    headers = [line for line in result.stdout.splitlines() if line.startswith("### ")]
    assert headers and headers[0].startswith(
        "### fast path, float32, per-tensor Adam: "
    )
    assert "aten::" in result.stdout
    rows = {
        line.split(" | ")[0].lstrip("| "): [
            float(x) for x in line.rstrip(" |").split(" | ")[1:]
        ]
        for line in result.stdout.splitlines()
        if line.startswith("| ") and not line.startswith("| kind")
    }
    assert "all" in rows and "dropout (masks and scaling, forward)" in rows
    assert (
        rows["dropout (masks and scaling, forward)"][0] > 0
    )  # the dropout modules' operators were found
    parts = [values[0] for name, values in rows.items() if name != "all"]
    assert abs(sum(parts) - rows["all"][0]) <= 0.05 * (
        len(parts) + 1
    )  # the kinds add up to the whole (rounding)
    rate = [
        line
        for line in result.stdout.splitlines()
        if line.startswith("matrix products while they ran")
    ]
    assert rate and float(rate[0].rsplit(": ", 1)[1]) > 0


def test_profile_categories_tell_the_kinds_of_work_apart(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import profile_step
    import torch
    from torch.profiler import ProfilerActivity, profile

    cat = profile_step.category
    assert (
        cat("aten::addmm", ["aten::linear"])
        == cat("aten::mm", ["AddmmBackward0"])
        == profile_step.CATEGORIES[0]
    )
    assert (
        cat("aten::bmm", []) == cat("aten::_softmax", []) == profile_step.CATEGORIES[1]
    )
    assert (
        cat("aten::mul", ["aten::dropout", profile_step.DROPOUT_LABEL])
        == profile_step.CATEGORIES[2]
    )
    assert (
        cat("aten::mul", ["MulBackward0"]) == profile_step.CATEGORIES[6]
    )  # backward of a dropout: not told apart
    assert (
        cat("aten::_log_softmax", [])
        == cat("aten::gather", [])
        == profile_step.CATEGORIES[3]
    )
    assert (
        cat("aten::_fused_adam_", ["Optimizer.step#Adam.step"])
        == profile_step.CATEGORIES[4]
    )
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 4), torch.nn.Dropout(0.5), torch.nn.Dropout(0.2)
    ).train()
    handles = profile_step.label_dropouts(model)
    assert len(handles) == 4  # a pre-hook and a hook for each of the two dropouts
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        model(torch.randn(3, 4))
    for handle in handles:
        handle.remove()
    kinds = profile_step.by_category(prof.events(), steps=1)
    assert (
        profile_step.matmul_rate(prof.events()) == 0.0
    )  # shapes were not recorded: no rate to give
    assert (
        kinds[profile_step.CATEGORIES[2]] > 0 and kinds[profile_step.CATEGORIES[0]] > 0
    )
    assert (
        not model[1]._forward_pre_hooks and not model[2]._forward_hooks
    )  # the labels are gone again


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_the_busy_process_ends_when_the_bench_that_started_it_is_gone():
    """A bench killed mid-measurement (no ``finally`` runs) leaves no busy loop."""
    starter = (
        f"import os, sys; sys.path.insert(0, {str(ROOT / 'benchmarks')!r})\n"
        "import bench\n"
        "print(bench.busy_process().pid, flush=True)\n"
        "os._exit(0)  # gone at once, without a word, as a SIGKILL leaves it\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", starter], capture_output=True, text=True, timeout=60
    )
    pid = int(out.stdout)

    def running() -> bool:  # a zombie waiting for its new parent counts as ended
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return False
        return stat.rsplit(")", 1)[1].split()[0] != "Z"

    deadline = time.monotonic() + 30
    while running() and time.monotonic() < deadline:
        time.sleep(0.1)
    if running():
        os.kill(pid, signal.SIGKILL)
        pytest.fail("the busy loop outlived the bench that started it")


def test_the_bench_adam_per_tensor_is_neither_fused_nor_foreach(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import bench
    import machinery
    import torch

    cfg = machinery.get_config("tiny")
    model = torch.nn.Linear(3, 2)
    per_tensor = bench.make_adam(model, cfg, fused=False)
    assert (
        per_tensor.defaults["foreach"] is False
        and per_tensor.defaults["fused"] is False
    )
    assert bench.make_adam(model, cfg).defaults["fused"] is True


def test_the_rows_take_every_place_in_the_step_order_alike(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import bench

    rows = ["a", "b", "c", "d", "e"]
    orders = [bench.rotated(rows, k) for k in range(3 * len(rows))]
    assert all(sorted(o) == rows for o in orders)  # every row steps once at every step
    for row in rows:  # over whole rounds, each row runs in each place equally often
        places = [o.index(row) for o in orders]
        assert sorted(places) == sorted(list(range(len(rows))) * 3)
    assert bench.rotated(rows, 7) == bench.rotated(rows, 2) == ["c", "d", "e", "a", "b"]
    assert rows == ["a", "b", "c", "d", "e"]  # the list itself is left as it was


def attention_flops(b: int, lq: int, lk: int, d_model: int, hk: int) -> int:
    """Forward FLOPs of one attention sub-layer (§3.2.2): Q from the queries' and K from
    the keys' side, each h·d_k wide; V and the output d_model wide (d_v = d_model/h);
    QK^T over h·d_k, the weighted sum over d_model."""
    projections = 2 * b * (lq * d_model * hk + lk * d_model * hk)
    projections += 2 * b * (lk * d_model * d_model + lq * d_model * d_model)
    return projections + 2 * b * lq * lk * (hk + d_model)


@pytest.mark.parametrize("d_k", [0, 4, 16])  # 0: d_k = d_model/h = 8
def test_flops_are_counted_right_where_h_times_d_k_is_not_d_model(monkeypatch, d_k):
    """A training pass is three times the forward's matrix products (each product's
    backward is two of its size), and those follow the shapes of Table 3's row (B)."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import bench
    import gpu_check
    import machinery

    cfg = machinery.get_config("copy", d_model=32, d_ff=64, h=4, N=1, d_k=d_k)
    (b, s), (_, t), d, vocab = (3, 7), (3, 8), 32, 14
    hk = 4 * (d_k or 8)
    encoder = attention_flops(b, s, s, d, hk) + 2 * 2 * b * s * d * 64
    decoder = attention_flops(b, t, t, d, hk) + attention_flops(b, t, s, d, hk)
    decoder += 2 * 2 * b * t * d * 64
    want = 3 * (encoder + cfg.decoder_layers * decoder + 2 * b * t * d * vocab)
    assert bench.training_flops(cfg, [((b, s), (b, t))], vocab, vocab) == want
    assert gpu_check.FlopCount(cfg, vocab, vocab)((b, s), (b, t)) == want
    assert bench.training_flops(cfg, [((b, s), (b, t))] * 2, vocab, vocab) == 2 * want


def test_each_wait_policy_is_measured_in_the_environment_it_names(report):
    """Section 6: every policy quiet and beside one busy process, each measuring
    process started with that policy alone and the usable cores' threads (one in the
    one-thread row); the machinery's default is marked; no timing is asserted, only
    that it was taken."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench
    from machinery.devices import WAIT_POLICY, usable_cores

    beside = report["json"]["beside"]
    rows = {r["policy"]: r for r in beside["rows"]}
    spins = {f"GOMP_SPINCOUNT={n}" for n in ("1000", "10000")}
    assert set(rows) == {"default (unset)", "PASSIVE", *spins, bench.ONE_THREAD}
    for name, r in rows.items():
        env = r["environment"]
        assert env["OMP_WAIT_POLICY"] == ("PASSIVE" if name == "PASSIVE" else None)
        assert env["GOMP_SPINCOUNT"] == (name.split("=")[1] if name in spins else None)
        threads = 1 if name == bench.ONE_THREAD else usable_cores()
        assert env["OMP_NUM_THREADS"] == str(threads) == str(env["threads"])
        assert positive(r["quiet_ms"]) and positive(r["busy_ms"])
        assert r["slowdown"] == pytest.approx(r["busy_ms"] / r["quiet_ms"])
        assert min(x["quiet_vs_best"] for x in rows.values()) == pytest.approx(1.0)
        assert r["machinery_default"] == (name == WAIT_POLICY)
    assert "beside one busy process" in report["stdout"]
    assert "(the machinery's default)" in report["stdout"]
    assert report["json"]["machine"]["omp_wait_policy"] == os.environ.get(
        "OMP_WAIT_POLICY", WAIT_POLICY
    )


def test_auto_batch_prints_each_paths_speed_and_autos_choice_per_size():
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "auto_batch.py"), "--config",
         "copy", "--tokens", "64,0", "--repeats", "1"],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    lines = [x for x in result.stdout.splitlines() if " tokens, measurement " in x]
    assert len(lines) == 2 and lines[0].lstrip().startswith("64 tokens")
    for line in lines:
        assert "fp32/readable 1.00×" in line and "fp32/fast" in line
        choice = r"auto: (fp32|bf16|fp16), (readable|fast) attention \(a clear win"
        assert re.search(choice, line), line
