"""The peak MFU is measured against: datasheet values matched to the right part and
precision, and a measured matmul peak that is cached per device, precision, torch
version and thread count."""

from __future__ import annotations

import json
import math
import sys

import pytest
import torch

import common.peak_flops as peak
from tools.peak import main as peak_command
from common.peak_flops import cache_key, datasheet_peak, device_peak, measured_peak
from conftest import run_warm


@pytest.mark.parametrize("name, precision, tflops", [
    ("NVIDIA H200 NVL", "bf16", 835),          # not the SXM H200's 989
    ("NVIDIA H200", "bf16", 989),
    ("NVIDIA H200", "tf32", 494.5),
    ("NVIDIA H100 NVL", "bf16", 835),
    ("NVIDIA H100 PCIe", "bf16", 756),
    ("NVIDIA H100 80GB HBM3", "bf16", 989),     # the SXM part's name
    ("NVIDIA H100 SXM5 80GB", "bf16", 989),
    ("NVIDIA A100-SXM4-80GB", "bf16", 312),
    ("NVIDIA A100 80GB PCIe", "tf32", 156),
    ("NVIDIA A100-SXM4-40GB", "fp32", 19.5),     # fp32 without tensor cores
    ("NVIDIA A10", "bf16", 125),
    ("NVIDIA L4", "bf16", 121),
    ("NVIDIA A10G", "bf16", None),              # contains "A10", another part
    ("NVIDIA L40S", "bf16", 362),               # contains "L4" and "L40": other parts
    ("NVIDIA L40", "tf32", 90.5),
    ("NVIDIA B200", "bf16", 2250),
    ("NVIDIA GH200 480GB", "bf16", 989),        # contains "H200": another part
    ("NVIDIA H800 PCIe", "bf16", 756),
    ("NVIDIA H100 80GB HBM3 MIG 1g.10gb", "bf16", None),   # a slice: measured, not 989
    ("NVIDIA A100-SXM4-40GB MIG 3g.20gb", "tf32", None),
    ("NVIDIA H100", "bf16", None),              # which H100? measure rather than guess
    ("NVIDIA GeForce RTX 4090", "bf16", None),
    ("CPU Intel(R) Xeon(R) Processor (2 cores)", "fp32", None),
])
def test_datasheet_peak(name, precision, tflops):
    want = None if tflops is None else tflops * 1e12
    assert datasheet_peak(name, precision) == want


def test_matmul_precision_follows_dtype_and_tf32_setting():
    """The TF32 switch and the peak's precision read the same setting. Torch 2.9 on has two
    APIs for it, and reading one that disagrees with the other raises; `set_tf32` writes
    both, so every reader (torch's compiler reads the old one in some versions) sees the
    same setting. The attributes exist without CUDA; a fresh interpreter, since the switch
    is process-wide."""
    code = """if True:
        import warnings
        warnings.simplefilter("error")   # no deprecation notice reaches the reader either
        import torch
        from common.environment import set_tf32, tf32_enabled
        from common.peak_flops import matmul_precision
        assert matmul_precision("cpu", "fp32") == "fp32" and matmul_precision("cuda", "bf16") == "bf16"
        matmul, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
        seen = []
        for on in (True, False, True):
            set_tf32(on)
            seen.append((tf32_enabled(), matmul_precision("cuda", "fp32"), matmul_precision("cpu", "fp32")))
            # (matmul.allow_tf32 reads cuBLAS's flag itself, which torch's compiler reads)
            old = (matmul.allow_tf32, cudnn.allow_tf32, torch.get_float32_matmul_precision())
            assert old == (on, on, "high" if on else "highest"), old
            new = [f.fp32_precision for f in (matmul, cudnn.conv, cudnn.rnn)]
            assert new == ["tf32" if on else "ieee"] * 3, new
        assert seen == [(True, "tf32", "fp32"), (False, "fp32", "fp32"), (True, "tf32", "fp32")], seen
        assert torch.backends.mkldnn.matmul.fp32_precision == "none"   # CPU matmuls untouched
        print("ok")
    """
    assert run_warm([sys.executable, "-c", code]).stdout.strip() == "ok"


def test_a_known_gpu_uses_its_datasheet_and_measures_nothing(monkeypatch, tmp_path):
    monkeypatch.setattr(peak, "device_name", lambda d: "NVIDIA H200 NVL")
    monkeypatch.setattr(peak, "measure_matmul_peak", lambda *a: pytest.fail("measured"))
    p = device_peak("cpu", "bf16", cache_dir=tmp_path)
    assert (p.flops, p.precision, p.source) == (835e12, "bf16", "datasheet")
    assert p.label() == "835 TFLOP/s (datasheet bf16 matmul peak)"


@pytest.fixture
def counted_measure(monkeypatch):
    """measure_matmul_peak, the real one, counting its calls."""
    calls = []
    real = peak.measure_matmul_peak

    def measure(device, precision):
        calls.append((torch.get_num_threads(), precision))
        return real(device, precision)

    monkeypatch.setattr(peak, "measure_matmul_peak", measure)
    return calls


def test_measured_peak_is_cached(tmp_path, counted_measure, monkeypatch):
    first = measured_peak("cpu", "fp32", cache_dir=tmp_path)
    assert math.isfinite(first) and first > 1e8    # any CPU of this century: > 0.1 GFLOP/s
    assert measured_peak("cpu", "fp32", cache_dir=tmp_path) == first   # from the cache
    assert len(counted_measure) == 1
    p = device_peak("cpu", "fp32", cache_dir=tmp_path)
    assert (p.flops, p.source, p.precision) == (first, "measured", "fp32")
    assert len(counted_measure) == 1


@pytest.mark.parametrize("content", ["[]", '"peak"', '{"%s": {"flops": "fast"}}', '{"%s": {"flops": -1}}'])
def test_a_cache_that_is_json_but_not_a_peak_is_measured_again(tmp_path, monkeypatch, content):
    """A matmul_peak.json that parses but holds no usable peak (another file copied there,
    an edited record) is measured again and rewritten, not an AttributeError or a
    TypeError at the end of every run that reads it."""
    monkeypatch.setattr(peak, "measure_matmul_peak", lambda device, precision: 1e9)
    key = peak.cache_key(peak.device_name(torch.device("cpu")), "fp32", "cpu")
    peak.cache_path(tmp_path).write_text(content.replace("%s", key))
    assert measured_peak("cpu", "fp32", cache_dir=tmp_path) == 1e9
    assert json.loads(peak.cache_path(tmp_path).read_text())[key]["flops"] == 1e9


def test_cache_key_holds_precision_threads_and_torch_version(tmp_path, counted_measure, monkeypatch):
    threads = torch.get_num_threads()
    measured_peak("cpu", "fp32", cache_dir=tmp_path)
    try:
        torch.set_num_threads(threads + 1)   # another process layout: another peak
        measured_peak("cpu", "fp32", cache_dir=tmp_path)
    finally:
        torch.set_num_threads(threads)
    assert counted_measure == [(threads, "fp32"), (threads + 1, "fp32")]
    keys = set(json.loads((tmp_path / peak.CACHE_FILE).read_text()))
    assert keys == {cache_key(peak.device_name("cpu"), "fp32", "cpu"),
                    cache_key(peak.device_name("cpu"), "fp32", "cpu").replace(
                        f"| {threads} threads", f"| {threads + 1} threads")}
    assert all(torch.__version__ in k for k in keys)
    assert cache_key("NVIDIA L40S", "bf16", "cuda") != cache_key("NVIDIA L40S", "tf32", "cuda")
    assert "threads" not in cache_key("NVIDIA L40S", "bf16", "cuda")


def test_remeasure_command_overwrites_the_cache(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("LLM_GUIDE_CACHE", str(tmp_path))
    key = cache_key(peak.device_name("cpu"), "fp32", "cpu")
    path = tmp_path / peak.CACHE_FILE
    path.write_text(json.dumps({key: {"flops": 1.0, "measured": "long ago"}}))
    peak_command(["--device", "cpu"])
    assert "cached" in capsys.readouterr().out
    assert json.loads(path.read_text())[key]["flops"] == 1.0   # a cache hit changes nothing
    peak_command(["--device", "cpu", "--remeasure"])
    out = capsys.readouterr().out
    assert "measured peak" in out and "measured now" in out
    assert json.loads(path.read_text())[key]["flops"] > 1e8


@pytest.mark.parametrize("device, cores, expected", [
    ("cpu", 16, 8),    # 2 processes on 16 cores: 8 threads each, the whole share
    ("cuda", 16, 4),   # on GPUs half the share: the rest is for loaders and NCCL's threads
    ("cuda", 64, 8),   # and at most 8
    ("cuda", 2, 1),
])
def test_thread_budget_per_process(monkeypatch, device, cores, expected):
    import common.environment as environment

    monkeypatch.setattr(environment.os, "sched_getaffinity", lambda pid: set(range(cores)))
    monkeypatch.setattr(environment.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(environment.dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(environment.dist, "all_gather_object",
                        lambda out, obj: out.__setitem__(slice(None), [obj, obj]))
    monkeypatch.delenv("LLM_GUIDE_THREADS", raising=False)
    before = torch.get_num_threads()
    try:
        assert environment.share_cpu_threads(device) == (expected, 2)
        assert torch.get_num_threads() == expected
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("value, expected", [("3", 3), (" 1 ", 1), ("", 4)])  # empty: the share
def test_llm_guide_threads_sets_the_threads_per_process(monkeypatch, value, expected):
    import common.environment as environment

    monkeypatch.setattr(environment.os, "sched_getaffinity", lambda pid: set(range(4)))
    monkeypatch.setenv("LLM_GUIDE_THREADS", value)
    before = torch.get_num_threads()
    try:
        assert environment.share_cpu_threads("cpu") == (expected, 1)
        assert torch.get_num_threads() == expected
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("value", ["0", "-1", "1.5", "two"])
def test_a_bad_llm_guide_threads_is_one_line_and_exit_2(monkeypatch, capsys, tmp_path, value):
    """Checked with the flags, before any work (a chapter's parser)."""
    from common.cli import base_parser

    monkeypatch.setenv("LLM_GUIDE_THREADS", value)
    before = torch.get_num_threads()
    with pytest.raises(SystemExit) as stop:
        base_parser("01-single-gpu", "test").parse_args(["--save-dir", str(tmp_path)])
    assert stop.value.code == 2 and torch.get_num_threads() == before
    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: LLM_GUIDE_THREADS={value!r}: must be a whole number >= 1 (CPU threads per process)"]


def test_a_cache_that_cannot_be_written_costs_one_warning_not_the_run(tmp_path, monkeypatch, capsys):
    """A read-only or full cache folder (here a file stands where the folder would be):
    the measured peak is still returned, with one warning line, so a finished run still
    writes its summary."""
    monkeypatch.setattr(peak, "measure_matmul_peak", lambda device, precision: 4e9)
    blocked = tmp_path / "not-a-folder"
    blocked.write_text("")
    assert measured_peak("cpu", "fp32", cache_dir=blocked / "cache") == 4e9
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("warning: ") and "measured again" in err, err


def test_an_unknown_device_is_one_line(capsys):
    with pytest.raises(SystemExit) as exit_:
        peak_command(["--device", "tpu"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--device" in err and "tpu" in err, err


def test_a_cpu_measurement_starts_small_and_stops_once_one_matmul_takes_a_second(monkeypatch):
    """bf16 on a CPU without bf16 instructions is emulated: fastest on small matrices (a
    few GFLOP/s at 128, where the model's own matmuls are), about 0.5 GFLOP/s at 1024, so
    a 1024 matmul takes 4 s and a 2048 one would take half a minute per call; the sizes
    stop at the first that took over a second, and the best of those measured is the peak."""
    seen = []

    def emulated(n, device, precision):
        seen.append(n)
        return 3e9 * 128 / n

    monkeypatch.setattr(peak, "best_matmul_flops", emulated)
    assert peak.measure_matmul_peak("cpu", "bf16") == 3e9 and seen == [128, 256, 512, 1024]
    seen.clear()
    monkeypatch.setattr(peak, "best_matmul_flops", lambda n, device, precision: seen.append(n) or 1e11)
    assert peak.measure_matmul_peak("cpu", "fp32") == 1e11 and seen == [128, 256, 512, 1024, 2048]


def test_an_n_by_n_matmul_counts_2_n_cubed_flops_at_its_best_time(monkeypatch):
    """A matmul of two n x n matrices is n^3 multiply-adds, 2 n^3 FLOPs; the peak is that
    over the fastest timed call (the warm-up call untimed): here the clock says the three
    timed calls took 3, 1 and 2 seconds."""
    ticks = iter([0.0, 3.0, 3.0, 4.0, 4.0, 6.0])
    monkeypatch.setattr(peak.time, "perf_counter", lambda: next(ticks))
    assert peak.best_matmul_flops(64, torch.device("cpu"), "fp32", reps=3, budget_s=100) == 2 * 64**3 / 1.0
    assert next(ticks, None) is None
