"""The seed benchmark (aotfuse.bench) in its tiny mode: rows, columns, numeric check, failure rows."""
from __future__ import annotations

import csv
import importlib.util
import os
import pathlib
import platform
import re

import pytest
import torch

pytest.importorskip("transformers")

from aotfuse import bench  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _benchmark(name: str):
    """benchmarks/<name>.py as a module."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


MD_COLUMNS = ["model", "dtype", "name", "time (s)", "mem (MB)", "time %", "mem %", "numeric check"]


def _table_rows(md: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip("|").split("|")] for line in md.splitlines()
            if line.startswith("| ") and not line.startswith("| model")]


def test_tiny_run_writes_table_with_numeric_check(tmp_path, capsys):
    paths = bench.main(["--device", "cpu", "--size", "tiny", "--models", "BertForMaskedLM", "--dtypes", "fp32",
                        "--backends", "eager,aotfuse,functorch", "--repeats", "2", "--out-dir", str(tmp_path),
                        "--name", "tiny", "--no-progress"])
    md = (tmp_path / "tiny.md").read_text()
    assert paths["md"] == str(tmp_path / "tiny.md") and paths["csv"] == str(tmp_path / "tiny.csv")
    header = next(line for line in md.splitlines() if line.startswith("| model"))
    for col in MD_COLUMNS:
        assert f" {col} |" in header, col
    assert "torch " + torch.__version__ in md and "transformers " in md and "CPUs" in md
    rows = {r[2]: r for r in _table_rows(md)}
    assert set(rows) == {"eager", "aotfuse", "functorch"}
    assert rows["eager"][5] == "100" and rows["eager"][6] == "100"
    assert rows["aotfuse"][0] == "BertForMaskedLM" and rows["aotfuse"][1] == "float32"
    assert rows["aotfuse"][9].startswith("pass"), rows["aotfuse"]
    float(rows["aotfuse"][3]), float(rows["aotfuse"][4]), float(rows["aotfuse"][7])  # measured, not "-"
    # functorch's memory_efficient_fusion either runs or is reported n/a with its reason; never a crash
    assert rows["functorch"][10] == "ok" or rows["functorch"][10].startswith("n/a: ")

    with open(tmp_path / "tiny.csv", newline="") as f:
        data = list(csv.DictReader(f))
    assert [r["name"] for r in data] == ["eager", "aotfuse", "functorch"]
    for key in ("model", "dtype", "name", "status", "time_s", "mem_bytes", "time_pct", "mem_pct", "check",
                "saved_bytes"):
        assert key in data[0]
    aot = data[1]
    assert aot["check"] == "pass" and aot["status"] == "ok"
    assert float(aot["time_s"]) > 0 and int(aot["mem_bytes"]) > 0 and int(aot["saved_bytes"]) > 0
    # the peak holds at least what is saved for the backward
    assert int(aot["mem_bytes"]) >= int(aot["saved_bytes"]), aot
    assert float(aot["loss_diff"]) <= 1e-4
    # every kernel ran as planned (a kernel falling back to ATen calls on every run is flagged in the status)
    assert aot["kernel_fallbacks"] == "0" and rows["aotfuse"][10] == "ok"
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "tiny.png").stat().st_size > 0
    else:
        assert "chart skipped" in capsys.readouterr().err


def test_host_size_and_the_aten_norms_contender(tmp_path):
    """--size host (the seed's 12 layers, minimal tensors) and aotfuse-aten-norms run and pass the check."""
    bench.main(["--device", "cpu", "--size", "host", "--models", "GPT2LMHeadModel", "--dtypes", "fp32",
                "--backends", "eager,aotfuse-aten-norms", "--repeats", "2", "--out-dir", str(tmp_path), "--name", "host",
                "--no-progress"])
    md = (tmp_path / "host.md").read_text()
    rows = {r[2]: r for r in _table_rows(md)}
    assert set(rows) == {"eager", "aotfuse-aten-norms"}
    assert rows["aotfuse-aten-norms"][9].startswith("pass") and rows["aotfuse-aten-norms"][10] == "ok", rows["aotfuse-aten-norms"]
    assert "12 layers" in md and "aotfuse-aten-norms (on request)" in md


def test_eager_sdpa_yardstick_runs_torchs_fused_attention(tmp_path, monkeypatch):
    """eager-sdpa switches the copy's attention to scaled_dot_product_attention (called once per
    layer and step) and passes the check; Longformer, with an attention of its own, is n/a."""
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def counting(*args, **kwargs):
        calls.append(1)
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counting)
    bench.main(["--device", "cpu", "--size", "tiny", "--models", "BertForMaskedLM,LongformerForMaskedLM",
                "--dtypes", "fp32", "--backends", "eager,eager-sdpa", "--repeats", "2", "--out-dir", str(tmp_path),
                "--name", "sdpa", "--no-progress"])
    md = (tmp_path / "sdpa.md").read_text()
    rows = {(r[0], r[2]): r for r in _table_rows(md)}
    bert = rows[("BertForMaskedLM", "eager-sdpa")]
    assert bert[9].startswith("pass") and bert[10] == "ok", bert
    assert rows[("LongformerForMaskedLM", "eager-sdpa")][10].startswith("n/a"), rows
    assert len(calls) >= 3  # Bert's one layer: the first step, the memory step and the timed ones
    assert "eager-sdpa (on request)" in md


def test_capture_failure_is_a_fallback_row_not_an_abort(tmp_path, monkeypatch):
    # Longformer calls .item() of its attention mask in its forward: without aotfuse's answers to such
    # questions (AOTFUSE_DECISIONS=0) it cannot be captured whole and falls back to eager
    monkeypatch.setenv("AOTFUSE_DECISIONS", "0")
    settings = bench.Settings(device="cpu", size="tiny", repeats=1, warmup=1)
    rows, _ = bench.run(["LongformerForMaskedLM"], ["fp32"], ["eager", "aotfuse"], settings, progress=False)
    by_name = {r.name: r for r in rows}
    aot = by_name["aotfuse"]
    assert aot.status == "fallback" and aot.reason, aot
    assert aot.time_s is not None and aot.check == "pass"
    paths = bench.write_results(rows, ["tiny Longformer"], str(tmp_path), settings, stem="fb")
    md = open(paths["md"]).read()
    assert "fallback (eager): " in md and "failures, fallbacks and n/a" in md


def test_contender_failing_after_its_first_step_is_a_failed_row(monkeypatch):
    real_make = bench._make

    def flaky_make(backend, model, fallback=False):
        if backend != "torch.compile":
            return real_make(backend, model, fallback)
        calls = []

        def call(**kwargs):
            calls.append(1)
            if len(calls) > 1:
                raise RuntimeError("boom")
            return model(**kwargs)
        return call

    monkeypatch.setattr(bench, "_make", flaky_make)
    settings = bench.Settings(device="cpu", size="tiny", repeats=2, warmup=2)
    rows, _ = bench.run(["BertForMaskedLM"], ["fp32"], ["eager", "torch.compile"], settings, progress=False)
    flaky = rows[1]
    assert flaky.status == "failed" and flaky.reason == "warm-up step: RuntimeError: boom"
    assert flaky.time_s is None and flaky.mem_bytes is None
    assert flaky.check == "pass"  # its first step ran and matched eager
    assert rows[0].status == "ok" and rows[0].time_s is not None


def test_kernel_fallbacks_are_flagged_in_the_status():
    """A kernel that fell back to ATen calls gives the right numbers slowly: the row says so."""
    row = bench.Result(model="m", dtype="float32", name="aotfuse", status="ok", time_s=1.0, mem_bytes=1, time_pct=100.0,
                       mem_pct=100.0, first_step_s=1.0, loss_diff=0.0, grad_diff=0.0, grad_worst="", check="pass",
                       reason="", kernel_fallbacks=12)
    assert bench._status_cell(row, "eager") == "ok (12 kernel calls ran as ATen calls)"
    row.status, row.reason = "fallback", "CaptureError"
    assert bench._status_cell(row, "dynamo") == "fallback (dynamo) (12 kernel calls ran as ATen calls): CaptureError"


def test_numeric_check_names_the_worst_gradient():
    ref = bench.Contender("eager", torch.nn.Linear(2, 2))
    ref.loss, ref.grads = torch.tensor(1.0), {"w": torch.zeros(3), "b": torch.zeros(2)}
    other = bench.Contender("x", torch.nn.Linear(2, 2))
    other.loss, other.grads = torch.tensor(1.0), {"w": torch.tensor([0.0, 0.5, 0.0]), "b": torch.zeros(2)}
    loss_diff, grad_diff, worst, check = bench._compare(other, ref, torch.float32)
    assert (loss_diff, grad_diff, worst, check) == (0.0, 0.5, "w", "FAIL")
    other.grads["w"] = torch.full((3,), 5e-5)
    assert bench._compare(other, ref, torch.float32)[3] == "pass"
    assert bench._compare(other, ref, torch.bfloat16)[3] == "pass"


def test_bad_arguments_are_rejected():
    with pytest.raises(SystemExit):
        bench.parse_args(["--models", "NotAModel"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--backends", "eager,tvm"])
    args = bench.parse_args(["--device", "cpu"])
    assert args.size == "reduced" and args.dtypes == ["fp32"] and args.models == list(bench.MODELS)


def test_profile_steps_lists_programs_and_kernels(capsys):
    """benchmarks/profile_steps.py: per-op host time of the C programs, then (--kernels) one step of
    each contender under torch.profiler (on the CPU its top ops by self CPU time)."""
    mod = _benchmark("profile_steps")
    mod.main(["--model", "GPT2LMHeadModel", "--size", "tiny", "--steps", "2", "--kernels", "--top", "3"])
    out = capsys.readouterr().out
    assert "inside the C programs" in out and "fused kernels" in out, out
    assert "aotfuse: one step, self CPU time" in out and "eager: one step, self CPU time" in out, out




def _ab_sides(out: str) -> tuple[dict, dict]:
    """ab_env.py's printout: each side's line ("=1:", "=0:") and its last loss; both sides present."""
    lines = {v: line for line in out.splitlines() for v in ("=1:", "=0:") if v in line}
    assert set(lines) == {"=1:", "=0:"}, out
    return lines, {v: float(line.rsplit("last loss ", 1)[1].split(",")[0]) for v, line in lines.items()}


def test_ab_env_times_both_sides_of_a_switch(capsys, monkeypatch):
    """benchmarks/ab_env.py: two copies lowered with the switch at its two values, trained alike
    (the same loss after the same steps), each side's time and peak printed; the variable is put
    back as it was."""
    ab_env = _benchmark("ab_env")
    monkeypatch.delenv("AOTFUSE_SINK_COPIES", raising=False)
    ab_env.main(["--env", "AOTFUSE_SINK_COPIES", "--model", "BertForMaskedLM", "--size", "host", "--repeats", "2",
                 "--warmup", "1"])
    out = capsys.readouterr().out
    lines, losses = _ab_sides(out)
    assert "A/B:" in out, out
    assert losses["=1:"] == pytest.approx(losses["=0:"], rel=1e-5), out
    assert all("peak" in line and " ms" in line for line in lines.values()), out
    assert "AOTFUSE_SINK_COPIES" not in os.environ


def test_ab_env_takes_a_model_of_the_families_benchmark(capsys, monkeypatch):
    """--family NAME builds benchmarks/families.py's model (Swin here): each side lowers its own
    programs (AOTFUSE_COLUMN_PHASED=1 runs its patch embedding's layer norm column-phased), both
    train alike."""
    ab_env = _benchmark("ab_env")
    monkeypatch.delenv("AOTFUSE_COLUMN_PHASED", raising=False)
    ab_env.main(["--env", "AOTFUSE_COLUMN_PHASED", "--family", "swin", "--dtype", "fp32", "--repeats", "1",
                 "--warmup", "1"])
    out = capsys.readouterr().out
    lines, losses = _ab_sides(out)
    assert "swin (benchmarks/families.py's size)" in out, out
    assert losses["=1:"] == pytest.approx(losses["=0:"], rel=1e-4), out
    assert all(int(re.search(r"(\d+) fused kernels", line).group(1)) > 0 for line in lines.values()), out
    assert "AOTFUSE_COLUMN_PHASED" not in os.environ


def test_ab_env_compiles_each_side_through_torch_compile(capsys, monkeypatch):
    """--torch-compile: each side is torch.compile(model, backend="aotfuse") with a backend of its own,
    lowered with the switch at its value (ResNet's channels-last convolutions: the sides' programs
    differ), both train alike."""
    ab_env = _benchmark("ab_env")
    monkeypatch.delenv("AOTFUSE_CHANNELS_LAST_CONVS", raising=False)
    ab_env.main(["--env", "AOTFUSE_CHANNELS_LAST_CONVS", "--family", "resnet", "--dtype", "fp32", "--repeats", "1",
                 "--warmup", "1", "--torch-compile"])
    out = capsys.readouterr().out
    lines, losses = _ab_sides(out)
    assert "torch.compile(backend='aotfuse')" in out, out
    assert losses["=1:"] == pytest.approx(losses["=0:"], rel=1e-4), out
    kernels = {k: int(re.search(r"(\d+) fused kernels", line).group(1)) for k, line in lines.items()}
    assert all(n > 0 for n in kernels.values()) and kernels["=1:"] != kernels["=0:"], out
    assert "AOTFUSE_CHANNELS_LAST_CONVS" not in os.environ


def test_ab_env_lowers_each_side_of_a_dynamo_fallback_model(capsys, monkeypatch):
    """Longformer runs through Dynamo (fallback="dynamo"), which keeps compiled graphs per code
    object, guarded on the backend: with one backend for both, side B ran side A's programs (both sides alike, every
    such A/B reading about 1.0). Each side must lower its own: with AOTFUSE_FUSION=0 no kernels."""
    ab_env = _benchmark("ab_env")
    monkeypatch.delenv("AOTFUSE_FUSION", raising=False)
    ab_env.main(["--env", "AOTFUSE_FUSION", "--model", "LongformerForMaskedLM", "--size", "tiny", "--repeats", "1",
                 "--warmup", "1"])
    out = capsys.readouterr().out
    counts = {v: re.search(r"(\d+) programs, (\d+) fused kernels", line).groups()
              for line in out.splitlines() for v in ("=1:", "=0:") if v in line}
    assert set(counts) == {"=1:", "=0:"}, out
    assert int(counts["=1:"][0]) >= 2 and int(counts["=0:"][0]) >= 2, out  # a forward and a backward each
    assert int(counts["=1:"][1]) > 0 and int(counts["=0:"][1]) == 0, out


def test_env_contenders_lower_with_their_variables_and_put_them_back(monkeypatch, tmp_path):
    """aotfuse+NAME=VALUE: the variables hold while the contender is made and while it steps (so its
    lowering reads them), not after; in a table beside plain aotfuse."""
    import copy

    from aotfuse.lower import LIVE

    monkeypatch.delenv("AOTFUSE_DECOMPOSE_NORMS", raising=False)
    model, inputs, _ = bench.build_model("BertForMaskedLM", "tiny", torch.float32, "cpu")
    kernels = {}
    for backend in ("aotfuse", "aotfuse+AOTFUSE_DECOMPOSE_NORMS=0"):
        c = bench.Contender(backend, copy.deepcopy(model), env=bench.backend_env(backend))
        before = set(LIVE)
        bench._first_step(c, backend, c.base, inputs, "cpu")
        assert c.status == "ok", c.reason
        made = set(LIVE) - before
        assert made
        kernels[backend] = sum(low.program.num_kernels for low in made)
        assert "AOTFUSE_DECOMPOSE_NORMS" not in os.environ
    # layer norms and softmax left to ATen: fewer fused kernels
    assert kernels["aotfuse+AOTFUSE_DECOMPOSE_NORMS=0"] < kernels["aotfuse"], kernels
    assert bench.backend_env("aotfuse+AOTFUSE_A=1+AOTFUSE_B=x") == {"AOTFUSE_A": "1", "AOTFUSE_B": "x"}
    assert bench.backend_env("aotfuse") == {}
    with pytest.raises(SystemExit):
        bench.parse_args(["--backends", "eager,aotfuse+PATH=/tmp"])  # only AOTFUSE_* variables
    args = bench.parse_args(["--backends", "eager,aotfuse+AOTFUSE_LM_GRAD_CHUNKS=0"])
    assert args.backends == ["eager", "aotfuse+AOTFUSE_LM_GRAD_CHUNKS=0"]
    bench.main(["--device", "cpu", "--size", "tiny", "--models", "BertForMaskedLM", "--dtypes", "fp32", "--backends",
                "eager,aotfuse+AOTFUSE_DECOMPOSE_NORMS=0", "--repeats", "2", "--out-dir", str(tmp_path), "--name", "env",
                "--no-progress"])
    rows = {r[2]: r for r in _table_rows((tmp_path / "env.md").read_text())}
    assert rows["aotfuse+AOTFUSE_DECOMPOSE_NORMS=0"][9].startswith("pass"), rows


def test_gpu_micro_runs_its_parts_on_the_cpu():
    """benchmarks/gpu_micro.py (gpu_check.sh's `diag` part) runs where a GPU is scarce only if it runs:
    every part, on the CPU, small."""
    import subprocess
    import sys

    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_micro.py"), "--device", "cpu", "--iters", "2",
                          "--vocab", "256", "--parts", "attn,lm,rng"], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PYTHONPATH": str(ROOT / "python")})
    assert res.returncode == 0, res.stderr[-3000:]
    lines = res.stdout.splitlines()
    assert any(l.startswith("attn  eager fwd+bwd") for l in lines), res.stdout
    assert sum(l.startswith("lm ") for l in lines) == 4, res.stdout
    assert sum(l.startswith("rng ") for l in lines) == 5, res.stdout


def test_deep_chain_reports_each_depth(tmp_path):
    """benchmarks/deep_chain.py (the planning time of a deep pointwise chain): one row per depth, the
    largest kernel within the fuser's bound."""
    import subprocess
    import sys

    out = tmp_path / "deep.md"
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "deep_chain.py"), "--layers", "2,20", "--steps", "2",
                          "--out", str(out)], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PYTHONPATH": str(ROOT / "python")})
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [r for r in _table_rows(out.read_text()) if r[0].isdigit()]
    assert [r[0] for r in rows] == ["2", "20"], out.read_text()
    for r in rows:
        first, lowering, largest = float(r[1]), float(r[2]), int(r[3])
        assert 0 < lowering < first and 0 < largest <= 256, r


def test_cpu_peak_does_not_depend_on_what_was_profiled_before():
    """The profiler reports the free of a block allocated before any profiling began without its
    size, and one allocated under an earlier profile with it: a step that frees the last step's
    gradients, then allocates, measured 4 MB or 0 by whether that last step ran under the profiler.
    Now the running total never goes below zero: 4 MB beyond the base either way."""
    mb4 = 1 << 20  # float32 elements

    def step(holder):
        holder[0] = None  # frees the previous step's tensor (4 MB)
        holder[0] = torch.ones(mb4)  # allocates a new one (4 MB)

    for profiled_before in (False, True):
        holder = [None]
        if profiled_before:
            bench._cpu_peak(lambda: step(holder))  # holder[0] allocated under a profile
        else:
            step(holder)
        assert bench._cpu_peak(lambda: step(holder)) == 4 * mb4, profiled_before


def test_chain_models_compares_both_cuts_with_eager(capsys):
    """benchmarks/chain_models.py: eager, aotfuse and AOTFUSE_RECOMPUTE_CHAINS=1 side by side, one row
    per model with steps, peaks and ratios; the variable put back after."""
    mod = _benchmark("chain_models")
    before = os.environ.get("AOTFUSE_RECOMPUTE_CHAINS")
    mod.main(["--models", "stack,bert", "--layers", "4", "--steps", "2"])
    assert os.environ.get("AOTFUSE_RECOMPUTE_CHAINS") == before
    rows = {r[0]: r for r in _table_rows(capsys.readouterr().out)}
    assert set(rows) == {"stack", "bert"}, rows
    for r in rows.values():
        values = [float(c) for c in r[1:]]
        assert len(values) == 8 and all(v > 0 for v in values), r
        assert abs(values[6] - values[4] / values[3]) < 2e-3 and abs(values[7] - values[5] / values[3]) < 2e-3, r
    stack = [float(c) for c in rows["stack"][1:]]
    assert stack[4] < stack[5], rows["stack"]  # 4 layers: a chain the default cut saves in part


def test_families_compares_eager_and_aotfuse_with_a_loss_check(tmp_path, capsys):
    """benchmarks/families.py: one row per model with eager's step and peak, aotfuse's ratios and
    first step, and the loss check against eager's (channels_last images too); the table written to
    --out with the machine line."""
    pytest.importorskip("transformers")
    mod = _benchmark("families")
    out = tmp_path / "families.md"
    mod.main(["--models", "resnet", "--steps", "2", "--contenders", "eager,aotfuse", "--channels-last",
              "--out", str(out)])
    rows = [r for r in _table_rows(capsys.readouterr().out) if r[0] == "resnet"]
    assert rows, "no resnet row"
    r = rows[-1]
    assert len(r) == 7 and all(float(c) > 0 for c in r[1:6]) and r[6] == "ok", r
    text = out.read_text()
    assert "channels_last" in text and "| resnet |" in text and "torch " in text
    model, inputs = mod.build("resnet", torch.float32, channels_last=True)
    assert inputs["pixel_values"].is_contiguous(memory_format=torch.channels_last)


def test_copies_times_each_case_against_eager(capsys):
    """benchmarks/copies.py: every layout-changing copy and the batch norm, in each dtype, checked
    against eager's values and timed beside it (a small scale)."""
    copies = _benchmark("copies")
    threads = torch.get_num_threads()
    try:
        rows = copies.main(["--scale", "0.1", "--repeats", "2"])
    finally:
        torch.set_num_threads(threads)
    assert len(rows) == 12 and {r[2] for r in rows} == {torch.float32, torch.bfloat16}
    assert all(ours > 0 and eager > 0 for *_, ours, eager in rows), rows
    assert capsys.readouterr().out.count("| batch norm, training |") == 2


def test_erf_check_measures_the_kernels_erf_against_float64():
    """benchmarks/erf_check.py builds the prelude's own af_erf (taken from csrc/codegen_c.c): every
    4099th float within 2.5e-7 of float64's erf, NaN, zeros and infinities right; the same polynomial
    given by --against differs in no bit, and a cruder one (h cut to its two lowest terms) is caught."""
    erf_check = _benchmark("erf_check")
    source = (ROOT / "csrc" / "codegen_c.c").read_text()
    erf = erf_check.prelude_function(source, "af_erf")
    current = re.findall(r"hq = (?:AF_FMA\(hq, ac, )?([-+0-9.e]+)f", erf)
    assert len(current) >= 2, erf
    r = erf_check.main(["--stride", "4099", "--against", " ".join(current)])
    assert 0 < r["error"] <= 2.5e-7 and r["special_failures"] == 0, r
    assert r["differ"] == 0 and r["other_error"] == r["error"], r
    crude = erf_check.main(["--stride", "4099", "--against", " ".join(current[-2:])])
    assert crude["other_error"] > 1e-4 and crude["differ"] > 0, crude


def test_erf_check_measures_erf1p_against_one_plus_erf():
    """--fn erf1p builds the prelude's af_erf1p: every 4099th float within 1.5e-7 of 1 + erf in
    double, within 1% of it in the negative tail where `1.0f + af_erf(x)` (measured beside it) is
    further off, NaN for NaN; a cruder h given by --against is caught."""
    erf_check = _benchmark("erf_check")
    source = (ROOT / "csrc" / "codegen_c.c").read_text()
    current = re.findall(r"hq = (?:AF_FMA\(hq, ac, )?([-+0-9.e]+)f", erf_check.prelude_function(source, "af_erf1p"))
    assert len(current) >= 2
    r = erf_check.main(["--fn", "erf1p", "--stride", "4099"])
    assert 0 < r["error"] <= 1.5e-7 and r["special_failures"] == 0, r
    assert 0 < r["tail"] <= 0.01 < r["other_tail"], r
    crude = erf_check.main(["--fn", "erf1p", "--stride", "4099", "--against", " ".join(current[-3:])])
    assert crude["other_error"] > 1e-4 and crude["differ"] > 0, crude


def test_exp_check_measures_af_exp_and_its_nonpositive_side(monkeypatch):
    """benchmarks/exp_check.py builds the prelude's af_exp and af_exp_nonpos (taken from
    csrc/codegen_c.c): every 4099th float's exp within 1.5 ulp of double's, special values right, and
    af_exp_nonpos's bits af_exp's at every float checked at most 0 and NaN; an af_exp_nonpos that adds
    2^n to y's bits (NaN's n is INT_MIN, so NaN came out a number) is caught."""
    exp_check = _benchmark("exp_check")
    r = exp_check.main(["--stride", "4099"])
    assert 0 < r["ulp"] <= 1.5 and r["special_failures"] == 0, r
    assert r["nonpos_checked"] > 500_000 and r["nonpos_differ"] == 0 and r["ns"] > 0 and r["nonpos_ns"] > 0, r
    prelude_function = exp_check.prelude_function
    broken = ("AF_INLINE float af_exp_nonpos(float x) {\n  float xc = x < -104.0f ? -104.0f : x;\n"
              "  float n = floorf(AF_FMA(xc, 1.44269504088896341f, 0.5f));\n  float r = AF_FMA(n, -0.693359375f, xc);\n"
              "  r = AF_FMA(n, 2.12194440e-4f, r);\n  float y = af_exp_poly(r) + 1.0f;\n"
              "  uint32_t u; memcpy(&u, &y, 4); u += (uint32_t)((int32_t)n + 64) << 23; memcpy(&y, &u, 4);\n"
              "  return y * 5.42101086242752217e-20f;\n}\n")
    monkeypatch.setattr(exp_check, "prelude_function",
                        lambda source, name: broken if name == "af_exp_nonpos" else prelude_function(source, name))
    bad = exp_check.main(["--stride", "4099"])
    assert bad["nonpos_differ"] > 0, bad


def test_libm_check_measures_the_kernels_functions_against_double_libm():
    """benchmarks/libm_check.py builds the prelude's own log, log2, log10, log1p, expm1, sin and cos
    (taken from csrc/codegen_c.c): every 4099th float within 2 ulp of double libm's, every special value
    right, and each timed against libm's float call; --march builds for another target."""
    libm_check = _benchmark("libm_check")
    r = libm_check.main(["--stride", "4099"])
    assert set(r) == set(libm_check.FUNCTIONS), r
    for name, row in r.items():
        assert 0 < row["ulp"] <= 2.0 and row["special_failures"] == 0 and row["ns"] > 0 and row["libm_ns"] > 0, (name, row)
    assert r["sin"]["wide_ns"] > 0 and r["log"]["wide_ns"] == 0
    other = libm_check.main(["--fn", "cos", "--stride", "40009", "--march", "x86-64-v3" if platform.machine() == "x86_64" else "native"])
    assert 0 < other["cos"]["ulp"] <= 2.0 and other["cos"]["special_failures"] == 0, other


def test_activations_benchmark_runs_each_side_with_a_loss_check(capsys):
    """benchmarks/activations.py: a row per case with eager's step and peak, the ratios of aotfuse and
    of aotfuse with ATen's activation kernels, and the loss check; the latter really kept ATen's."""
    mod = _benchmark("activations")
    mod.main(["--cases", "mish,huber", "--steps", "2", "--dim", "32", "--tokens", "64",
              "--contenders", "eager,aotfuse,aotfuse-aten"])
    rows = {r[0]: r for r in _table_rows(capsys.readouterr().out) if r[0] in ("mish", "huber")}
    assert set(rows) == {"mish", "huber"}, rows
    for r in rows.values():
        assert len(r) == 10 and all(float(c) > 0 for c in r[1:9]) and r[9] == "ok", r
    call = mod._compile("mish", "aotfuse-aten", mod.Block(8, mod.ACTIVATIONS["mish"], torch.nn.functional.mse_loss))
    call(x=torch.randn(4, 8), target=torch.randn(4, 8)).loss.backward()
    compiled = call.compiled
    ops = {op for low in compiled._aotfuse_compiled.records[-1].programs.values() for op, _k, g in low.program.node_groups() if g < 0}
    assert "aten::mish.default" in ops and "aten::mish_backward.default" in ops, ops


def test_depthwise_benchmark_runs_three_sides_and_measures_their_gradients():
    """benchmarks/depthwise.py at its tiny shape: eager, aotfuse and aotfuse with ATen's weight gradient
    each timed, their peaks measured, each weight gradient as near float64's as fp32 allows."""
    depthwise = _benchmark("depthwise")
    rows = depthwise.main(["--shapes", "tiny", "--steps", "2"])
    assert len(rows) == 1
    for side in ("eager", "aotfuse", "aten"):
        r = rows[0][side]
        assert r["ms"] > 0 and r["peak"] > 0 and r["far"] < 1e-4, (side, r["ms"], r["peak"], r["far"])


def test_depthwise_benchmark_strided_with_the_input_gradient():
    """--stride 2 --input-grad in bf16: the input gradient's distance from float64 is measured on every
    side, and aotfuse's (float32's transposed convolution, rounded once) is no farther than eager's."""
    depthwise = _benchmark("depthwise")
    rows = depthwise.main(["--shapes", "tiny", "--steps", "2", "--kernel", "3", "--stride", "2", "--input-grad",
                           "--dtype", "bf16"])
    sides = rows[0]
    for side in ("eager", "aotfuse", "aten"):
        r = sides[side]
        assert r["ms"] > 0 and 0 < r["far_in"] < 0.05, (side, r)
    assert sides["aotfuse"]["far_in"] <= sides["eager"]["far_in"] * 1.01, sides


def test_float16_ops_benchmark_times_both_ways(capsys):
    """benchmarks/float16_ops.py: a row per op (four mm layouts, bmm, a convolution's and SDPA's
    training step) with ATen's 16-bit time, the float32-with-conversions time and their ratio."""
    mod = _benchmark("float16_ops")
    mod.main(["--scale", "0.05", "--repeats", "1"])
    rows = [r for r in _table_rows(capsys.readouterr().out) if r[0] != "op"]
    assert [r[0] for r in rows] == ["mm a @ b", "mm a @ b^T", "mm a^T @ b", "mm a^T @ b^T", "bmm", "conv 3x3 step",
                                    "sdpa step"], rows
    for r in rows:
        assert len(r) == 4 and all(float(c) > 0 for c in r[1:]), r


def test_cats_benchmark_times_both_ways(capsys):
    """benchmarks/cats.py: a row per case and dtype with eager's time, ATen's cat's and the windows'
    kernels and times, and their ratio; the windows make fewer kernels for the rotary cat."""
    mod = _benchmark("cats")
    mod.main(["--dtypes", "fp32,bf16", "--repeats", "2", "--scale", "0.1"])
    rows = [r for r in _table_rows(capsys.readouterr().out) if r[0] != "case"]
    assert len(rows) == 6 and [r[1] for r in rows] == ["fp32"] * 3 + ["bf16"] * 3, rows
    for r in rows:
        assert len(r) == 6 and float(r[2]) > 0 and float(r[5]) > 0, r
        (k_aten, ms_aten), (k_win, ms_win) = [[float(v) for v in c.split(",")] for c in r[3:5]]
        assert k_aten >= 1 and k_win >= 1 and ms_aten > 0 and ms_win > 0, r
    rotary = [r for r in rows if r[0].startswith("rotary")]
    assert all(r[3].startswith("2,") and r[4].startswith("1,") for r in rotary), rotary


def test_tf32_flag_sets_torchs_switches_and_says_so(tmp_path):
    """--tf32 (gpu_check.sh's tf32 part): torch's TF32 switches on for every contender, and the
    results' notes say so; without it they stay as torch left them."""
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        bench.main(["--device", "cpu", "--size", "tiny", "--models", "BertForMaskedLM", "--dtypes", "fp32",
                    "--backends", "eager", "--repeats", "1", "--warmup", "1", "--out-dir", str(tmp_path),
                    "--name", "tf32", "--no-progress", "--tf32"])
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
        assert "- TF32: every contender's CUDA float32 matmuls" in (tmp_path / "tf32.md").read_text()
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before
    bench.main(["--device", "cpu", "--size", "tiny", "--models", "BertForMaskedLM", "--dtypes", "fp32",
                "--backends", "eager", "--repeats", "1", "--warmup", "1", "--out-dir", str(tmp_path),
                "--name", "plain", "--no-progress"])
    assert "TF32" not in (tmp_path / "plain.md").read_text()


def test_sweep_runs_one_family_and_classifies_it(tmp_path):
    """benchmarks/sweep.py: a family built at its tiny size from its config class, trained by
    compare_models in a subprocess, one classified row in the results file."""
    import subprocess
    import sys

    out = tmp_path / "sweep.md"
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "sweep.py"), "--only", "llama", "--tasks", "causal",
                          "--dtypes", "fp32", "--out", str(out)], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PYTHONPATH": str(ROOT / "python")})
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [r for r in _table_rows(out.read_text()) if len(r) == 6 and r[0] == "causal"]
    assert [r[:4] for r in rows] == [["causal", "llama", "fp32", "ok"]], out.read_text()
    assert "0 mismatches" in rows[0][5]
    # --resume keeps the file's rows and runs only the missing ones
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "sweep.py"), "--only", "llama", "--tasks", "causal",
                          "--dtypes", "fp32,bf16", "--out", str(out), "--resume"], capture_output=True, text=True,
                         timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT / "python")})
    assert res.returncode == 0, res.stderr[-3000:]
    rows2 = [r for r in _table_rows(out.read_text()) if len(r) == 6 and r[0] == "causal"]
    assert sorted(r[:4] for r in rows2) == [["causal", "llama", "bf16", "ok"], ["causal", "llama", "fp32", "ok"]], \
        out.read_text()
    assert [r for r in rows2 if r[2] == "fp32"] == rows, "the resumed run redid a row it had"
    assert "2 of 2 rows done" in out.read_text() and "resumed:" in out.read_text()


@pytest.mark.parametrize("task,name", [("image", "swin"), ("image", "cvt"), ("masked", "reformer"), ("masked", "xmod"),
                                       ("seq2seq", "qwen2_audio"), ("seq2seq", "fsmt"), ("causal", "llama4"),
                                       ("image", "siglip2"), ("image", "imagegpt"), ("image", "pp_lcnet"),
                                       ("causal", "dbrx"), ("causal", "xlstm"), ("causal", "reformer"),
                                       ("causal", "qwen4_exp_text"), ("causal", "musicgen"), ("image", "shieldgemma2"),
                                       ("seq2seq", "voxtral_realtime"), ("causal", "bamba"), ("causal", "granitemoehybrid"),
                                       ("causal", "cohere_compass_text"), ("masked", "perceiver")])
def test_sweep_builds_families_its_tiny_sizes_did_not_fit(task, name):
    """benchmarks/sweep.py's per-family fields (FAMILIES: Swin's window, CvT's default sizes, Reformer's
    axial shape), X-MOD's default language, a composite's text config for its causal model (Llama 4),
    a decoder-only seq2seq model's labels (Qwen2-Audio), FSMT's decoder ids, Siglip2's patch rows with
    their spatial shapes and ImageGPT's colour ids: each of these was a skipped row (the tiny build or
    eager failed); now eager trains the first variant in float32. PP-LCNet's model ignores its labels:
    `loss_of` sums its outputs (the CUDA emulation sweep had failed on its missing loss). Since the
    fifty-fifth session: a sub-config's field (DBRX's attention), a bool and an undeclared field
    (xLSTM's cache, ShieldGemma2's answer tokens), one task's fields (Reformer's causal LM is a decoder),
    Qwen4-Exp's indexer sizes, MusicGen's codebook rows, ShieldGemma2's image tokens, Voxtral
    Realtime's audio frames, Bamba's and Granite MoE hybrid's attention layer, Cohere Compass's rotary parameters and Perceiver's
    masked-LM queries (one a position)."""
    import sys

    pytest.importorskip("transformers")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import sweep
    make, inputs, label = sweep.first_runnable(task, name, None, torch.float32)
    assert label == "", label
    model = make()
    loss = sweep.loss_of(model(**inputs))
    assert loss.isfinite() and loss.requires_grad


def test_sweep_entry_torch_compile_runs_the_row_through_the_aotfuse_backend(monkeypatch):
    """`sweep.py --entry torch.compile` compiles each row's model with torch.compile(backend="aotfuse"),
    not memory_efficient_fusion (a stand-in that raises shows it is not called), and the row compares
    as the default entry's does."""
    import sys

    import aotfuse.compile

    pytest.importorskip("transformers")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import sweep
    backends = []
    real = torch.compile

    def recording(model, **kw):
        backends.append(kw.get("backend"))
        return real(model, **kw)

    def refuse(*a, **k):
        raise AssertionError("memory_efficient_fusion was called")

    monkeypatch.setattr(torch, "compile", recording)
    monkeypatch.setattr(aotfuse.compile, "memory_efficient_fusion", refuse)
    torch._dynamo.reset()
    threads = torch.get_num_threads()
    try:
        res = sweep.run_one("causal", "llama", "fp32", None, "torch.compile")
    finally:  # run_one makes this process single-threaded, as a sweep's row process is
        torch.set_num_threads(threads)
    assert res["cls"] == "ok" and res["mismatches"] == 0, res
    assert backends == ["aotfuse"], backends


def test_first_runnable_builds_a_family_at_its_config_sizes_once(monkeypatch):
    """A family built at its config's own sizes (FAMILIES' `defaults`) ignores VARIANTS' fields, so when
    its eager run fails there is nothing else to try: first_runnable builds it once (it built the same
    model four times and labelled the row with a variant that changed nothing) and says why; a tiny-size
    family tries every variant."""
    import sys

    pytest.importorskip("transformers")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import sweep
    builds = []

    def failing_check(make, inputs, dtype):
        raise RuntimeError("eager failed")

    monkeypatch.setattr(sweep, "build", lambda *a, **k: builds.append(a) or (None, None))
    monkeypatch.setattr(sweep, "_eager_check", failing_check)
    with pytest.raises(sweep.NotRunnable, match="eager failed"):
        sweep.first_runnable("image", "cvt", None, torch.float32)
    assert len(builds) == 1, builds
    builds.clear()
    with pytest.raises(sweep.NotRunnable):
        sweep.first_runnable("causal", "llama", None, torch.float32)
    assert [b[3] for b in builds] == list(range(len(sweep.VARIANTS))), builds


def test_cuda_emu_sweep_runs_one_family_through_the_emulation_and_nvrtc():
    """benchmarks/cuda_emu_sweep.py: a family's training-step programs as CUDA, every group emulated
    against eager and every kernel compiled by NVRTC, one row with its counts."""
    import subprocess
    import sys

    sys.path.insert(0, str(ROOT / "tests"))
    import cuda_emu
    from aotfuse.nvrtc_check import nvrtc_available
    why = cuda_emu.unavailable() or nvrtc_available()
    if why:
        pytest.skip(f"no CUDA emulation or NVRTC here: {why}")
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "cuda_emu_sweep.py"), "--only", "llama",
                          "--dtypes", "bf16"], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PYTHONPATH": str(ROOT / "python")})
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [r for r in _table_rows(res.stdout) if len(r) == 12 and r[0] == "llama"]
    assert len(rows) == 1 and rows[0][:4] == ["llama", "bf16", "-", "ok"], res.stdout  # the first variant ran
    assert int(rows[0][5]) > 20 and int(rows[0][8]) > 20, rows  # groups emulated, kernels compiled
    assert rows[0][6:8] == ["0", "0"], rows  # none skipped, no recompute left unchecked
