"""Chapter 03's DDP knobs, from one launch on gloo (tiny preset, 4 steps), on what does
not depend on the machine's load: one bucket in the first step, then the all-reduces
per step fall as bucket_cap_mb grows,
every fp32 setting sends each gradient once, the bf16 hook sends exactly half the bytes,
gradient_as_bucket_view leaves no gradient outside DDP's buckets, and every fp32 setting
trains to the same losses bit for bit (2 ranks) while bf16 differs, slightly."""

from __future__ import annotations

import pytest

from conftest import TINY, load_script, read_json, refused, run_warm
from pages import readme_command

SCRIPT = "03-ddp/ddp_knobs.py"
CAPS = [0.01, 0.1, 1.0]
STEPS = 4


@pytest.fixture(scope="module")
def knobs(tmp_path_factory):
    save = tmp_path_factory.mktemp("knobs")
    caps = ",".join(map(str, CAPS))
    proc = run_warm([*readme_command("03-ddp/README.md", "03-ddp/ddp_knobs.py"), *TINY[:6],  # preset, sequence, batch
                "--steps", STEPS, "--bucket-caps", caps, "--save-dir", save, "--experiment-name", "k"], timeout=300)
    return proc, read_json(save / "k" / "ddp_knobs.json")


def test_fewer_larger_all_reduces_as_bucket_cap_mb_grows(knobs):
    _, out = knobs
    s = out["settings"]
    calls = [s[f"bucket_cap_mb={c:g}"]["allreduces_per_step"] for c in CAPS]
    assert calls == sorted(calls, reverse=True) and calls[0] > calls[-1] >= 1, calls
    for c in CAPS:  # one all-reduce per bucket, and the buckets hold every gradient
        r = s[f"bucket_cap_mb={c:g}"]
        assert len(r["bucket_mib"]) == r["allreduces_per_step"]
        assert sum(r["bucket_mib"]) == pytest.approx(out["num_params"] * 4 / 2**20, abs=0.02)


def test_each_gradient_is_sent_once_and_bf16_sends_half(knobs):
    _, out = knobs
    s = out["settings"]
    fp32_bytes = out["num_params"] * 4
    for name, r in s.items():
        if name != "bf16 hook":
            assert r["bytes_per_step"] == fp32_bytes, name
    assert s["bf16 hook"]["bytes_per_step"] * 2 == fp32_bytes
    for name in ("static_graph", "gradient_as_bucket_view"):  # the default's buckets
        assert s[name]["bucket_mib"] == s["default"]["bucket_mib"], name
    assert s["bf16 hook"]["allreduces_per_step"] == s["default"]["allreduces_per_step"]
    for r in s.values():  # before DDP rebuilds its buckets in backward's order: one for all
        assert r["allreduces_first_step"] == 1


def test_gradient_as_bucket_view_saves_one_gradient_copy(knobs):
    _, out = knobs
    s = out["settings"]
    assert s["default"]["grad_bytes_outside_buckets"] == out["num_params"] * 4
    assert s["gradient_as_bucket_view"]["grad_bytes_outside_buckets"] == 0


def test_the_settings_train_alike_and_bf16_nearly(knobs):
    proc, out = knobs
    s = out["settings"]
    base = s["default"]["losses"]
    assert len(base) == STEPS
    for name, r in s.items():
        if name != "bf16 hook":  # a + b on 2 ranks, in whatever bucket: exact
            assert r["losses"] == base, name
    bf16 = s["bf16 hook"]["losses"]
    assert bf16[0] == base[0]  # the first loss comes before any update
    assert 0 < max(abs(a - b) for a, b in zip(bf16, base)) < 1e-2
    for title in ("| bucket_cap_mb |", "| gradient_as_bucket_view |", "| static_graph |", "| hook ",
                  "| step | loss fp32 |"):
        assert title in proc.stdout


def test_bad_bucket_caps_are_refused(capsys):
    script = load_script(SCRIPT)
    assert "--bucket-caps" in refused(capsys, script.parse_args, ["--bucket-caps", "25,5"])
    assert "--bucket-caps" in refused(capsys, script.parse_args, ["--bucket-caps", "0"])
