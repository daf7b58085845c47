"""Chapter 05 on GPUs, checked on a CPU: every collective the scripts and their helpers
call sends tensors on the process group's device (nccl takes only GPU tensors); the
benchmark asks about each rank's own GPU only after set_device; the proofs run in fp64
with exact kernels, the timed steps in the training dtype without them.

The device check works by moving the default device elsewhere: inside
`tensors_made_without_a_device_land_on_meta`, a tensor created without `device=` lands
on `meta`, so a collective given one (the bug of an nccl run: a CPU tensor) is caught by
the recording wrapper, while tensors derived from the demo's device stay on the CPU."""

from __future__ import annotations

import argparse
import sys

import pytest
import torch
import torch.distributed as dist

from conftest import chapter_module, load_script

from common.environment import set_tf32, tf32_enabled  # noqa: E402
proof = chapter_module("05-collectives", "proof")
sharding = chapter_module("05-collectives", "sharding")

demo_script = load_script("05-collectives/collectives_demo.py")
bench = load_script("05-collectives/bench_collectives.py")
scratch = load_script("05-collectives/ddp_from_scratch.py")
sharded = load_script("05-collectives/sharded_from_scratch.py")

COLLECTIVES = ("all_reduce", "broadcast", "reduce", "all_gather", "gather", "scatter", "reduce_scatter",
               "all_to_all", "all_gather_into_tensor", "reduce_scatter_tensor", "all_gather_single",
               "reduce_scatter_single")


def tensors_in(values):
    for v in values:
        if isinstance(v, torch.Tensor):
            yield v
        elif isinstance(v, (list, tuple)):
            yield from tensors_in(v)


@pytest.fixture
def group(one_rank_group, monkeypatch):
    """A one-rank gloo group, and every torch.distributed collective (as the scripts and
    helpers call them) wrapped: it records each tensor's device and fails at once when
    the device is not the demo's. Yields (demo, sent)."""
    demo, sent = one_rank_group, []

    def recorded(name, fn):
        def call(*args, **kwargs):
            for t in tensors_in([*args, *kwargs.values()]):
                sent.append((name, t.device))
                assert t.device == demo.device, f"{name} was given a tensor on {t.device}, not {demo.device}"
            return fn(*args, **kwargs)
        return call
    for name in COLLECTIVES:
        if hasattr(dist, name):
            monkeypatch.setattr(dist, name, recorded(name, getattr(dist, name)))
    for name in ("all_gather_single", "reduce_scatter_single"):  # bound when sharding.py loaded
        monkeypatch.setattr(sharding, name, recorded(name, getattr(sharding, name)))
    yield demo, sent


def tensors_made_without_a_device_land_on_meta():
    return torch.device("meta")


# ------------------------------------------------ 1. collectives on the demo's device

def test_sharded_measuring_and_proving_use_the_demos_device(group, monkeypatch):
    demo, sent = group
    args = argparse.Namespace(seed=0, lr=1e-3, modes=["ddp", "zero1", "zero3", "fsdp2"])
    config = sharded.get_config("tiny", 300)
    trainers = {m: sharded.TRAINERS[m](m, args, config, demo, torch.float64) for m in args.modes}
    x = torch.randint(0, 300, (2, 16))
    for t in trainers.values():
        t.step(x, x)
    # prove() builds its trainers, then steps them, compares them and hands DDP's state on:
    # give it those built above, and check its steps, comparisons and hand-overs
    monkeypatch.setattr(sharded, "TRAINERS", {m: lambda mode, *_: trainers[mode] for m in args.modes})
    sent.clear()
    with tensors_made_without_a_device_land_on_meta():
        diffs, failures, bound = sharded.prove(args, config, demo, [(x, x)])
        results = {m: sharding.measure(t, 0, 32) for m, t in trainers.items()}
        for t in trainers.values():
            assert sharding.peak_step_bytes(t, (x, x)) > 0
    assert failures == [] and bound == 0.0  # one rank: nothing to reorder
    assert all(r["step_time_s_median"] > 0 and len(r["losses"]) == 2 for r in results.values())
    names = {name for name, _ in sent}
    assert {"all_reduce", "broadcast", "all_gather_single"} <= names, names  # the helpers really ran


def test_ddp_from_scratch_measuring_and_proving_use_the_demos_device(group, monkeypatch):
    demo, sent = group
    args = argparse.Namespace(seed=0, lr=1e-3, bucket_mb=0.5, modes=["naive", "bucketed", "overlap", "ddp"],
                              proof_steps=2, steps=2, timing_warmup=0, tokens_per_step=32)
    config = scratch.get_config("tiny", 300)
    x = torch.randint(0, 300, (2, 16))
    batches = [(x, x)] * 2
    built = scratch.make_replicas(args, config, demo, torch.float64)
    for r in built.values():  # AdamW's first step, before: torch 2.11 makes its step counter
        r.step(x, x)          # without device= (a CPU scalar, by design), which meta would catch
    timed = scratch.run_modes(args, config, batches, demo, "", torch.float32)
    # prove() builds its replicas, then steps, compares and hands DDP's state on; time_modes()
    # trains through run_modes, then measures: give them those made above
    monkeypatch.setattr(scratch, "make_replicas", lambda *a, **k: built)
    monkeypatch.setattr(scratch, "run_modes", lambda *a, **k: timed)
    sent.clear()
    with tensors_made_without_a_device_land_on_meta():
        result, failures, bound = scratch.prove(args, config, batches, demo)
        measured = scratch.time_modes(args, config, batches, demo)
    assert failures == [] and bound == 0.0
    assert all(p["max_abs_diff_vs_ddp"] == 0.0 for p in result.values())
    assert all(r["step_time_s_median"] > 0 for r in measured.values())
    assert {"all_reduce", "broadcast"} <= {name for name, _ in sent}


def test_bench_and_demo_collectives_use_the_demos_device(group):
    demo, sent = group
    with tensors_made_without_a_device_land_on_meta():
        for op in bench.OPS:
            assert bench.supported(op, torch.float32, 1, demo.device) is None
            row = bench.measure(op, 4096, torch.float32, 1, demo.device, 2, 1)
            assert row["time_s"] > 0 and row["bytes"] == 4096
        for emulate in (False, True):
            d = demo_script.Demo(0, 1, demo.device, emulate)
            for op in demo_script.OPS:
                getattr(d, op)()
            assert d.failures == []
    assert {name for name, _ in sent} >= {"all_reduce", "reduce", "broadcast", "all_gather", "gather",
                                          "scatter", "reduce_scatter", "all_to_all"}


def test_the_check_catches_a_tensor_made_on_the_cpu(group):
    """The test's own premise: a tensor made without `device=` (on the CPU in an nccl
    run) does reach the wrapper on another device, and fails there."""
    with tensors_made_without_a_device_land_on_meta(), pytest.raises(AssertionError, match="on meta"):
        dist.all_reduce(torch.tensor([1.0]))


# ---------------------------------- 2. the benchmark asks about its own GPU, after set_device

@pytest.fixture
def eight_fake_gpus(monkeypatch):
    """torch.cuda as on an 8-GPU machine; records every call that touches a GPU, and
    which GPU it touched. GPU 0 has plenty of free memory, GPU 3 little."""
    calls, current = [], {"index": 0}
    free = {i: 70 * 2**30 for i in range(8)}
    free[3] = 10 * 2**30

    def set_device(device):
        current["index"] = torch.device("cuda", device).index if isinstance(device, int) else device.index
        calls.append(("set_device", current["index"]))

    def mem_get_info(device=None):
        index = current["index"] if device is None else torch.device(device).index
        calls.append(("mem_get_info", index))
        return free[index], 80 * 2**30

    def init_process_group(backend, **kwargs):  # nccl stands in: gloo, one rank
        calls.append(("init_process_group", backend))
        dist.init_process_group.__wrapped__("gloo", store=dist.HashStore(), rank=0, world_size=1)

    init_process_group.__wrapped__ = dist.init_process_group
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    for k, v in {"RANK": "3", "LOCAL_RANK": "3", "WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"}.items():
        monkeypatch.setenv(k, v)
    yield calls
    if dist.is_initialized():
        dist.destroy_process_group()


def test_bench_checks_its_own_gpu_after_set_device(eight_fake_gpus, monkeypatch, tmp_path, capsys):
    calls = eight_fake_gpus
    tf32 = tf32_enabled()
    # 8 GiB messages need 16 GiB on each GPU: GPU 3 has 10 free. (GPU 0's 70 GiB times
    # 8 GPUs would have let it through.)
    monkeypatch.setattr(sys, "argv", ["bench_collectives.py", "--max-bytes", str(8 * 2**30),
                                      "--save-dir", str(tmp_path / "out")])
    assert bench.main() == 2
    assert calls[0] == ("set_device", 3), calls  # nothing touched a GPU before set_device
    assert ("mem_get_info", 3) in calls and not any(c == ("mem_get_info", 0) for c in calls), calls
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: --max-bytes {8 * 2**30}: the largest buffers need about 16.0 GiB on GPU 3 and "
                   f"10.0 GiB are available; lower --max-bytes"], err
    assert not (tmp_path / "out").exists()
    # 3. start_group leaves the fast fp32 kernels alone: the timed steps may use TF32
    assert tf32_enabled() == tf32 and not torch.are_deterministic_algorithms_enabled()


def test_bench_memory_on_a_cpu_counts_every_rank_of_the_machine():
    cpu = torch.device("cpu")
    assert bench.memory_error(1024, cpu, 8) is None
    error = bench.memory_error(2**44, cpu, 8)
    assert "need about 393216.0 GiB on this machine (8 ranks)" in error


# ------------------------------------ 3. prove in fp64 with exact kernels, time without

def test_exact_kernels_is_on_only_while_the_proof_runs():
    tf32, det = tf32_enabled(), torch.are_deterministic_algorithms_enabled()
    with proof.exact_kernels():
        assert torch.are_deterministic_algorithms_enabled() and not tf32_enabled()
    assert tf32_enabled() == tf32 and torch.are_deterministic_algorithms_enabled() == det


FLAGS = ["--model-preset", "tiny", "--seq-length", "32", "--batch-size", "2", "--proof-steps", "2",
         "--steps", "3", "--timing-warmup", "1"]


@pytest.fixture
def torchrun_env(monkeypatch):
    """RANK and WORLD_SIZE as torchrun sets them: the flags' checks pass."""
    for k, v in {"RANK": "0", "WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(k, v)


def steps_seen(monkeypatch, cls, run):
    """Every training step `run()` takes, as each ends with `cls.update` (the proof's steps
    and the timed ones alike): (mode, weight dtype, deterministic kernels on, TF32 on),
    with TF32 on at the start as a GPU run starts (set through torch's API and put back by
    hand: pytest's monkeypatch cannot restore a flag that cuBLASModule keeps outside its
    __dict__)."""
    seen, update = [], cls.update

    def recording_update(self):
        seen.append((self.mode, next(self.model.parameters()).dtype,
                     torch.are_deterministic_algorithms_enabled(), tf32_enabled()))
        return update(self)
    monkeypatch.setattr(cls, "update", recording_update)
    was = tf32_enabled()
    set_tf32(True)
    try:
        assert run() == 0
    finally:
        set_tf32(was)
    proof_steps = [(m, d) for m, d, det, tf32 in seen if det and not tf32]
    timed = [(m, d) for m, d, det, tf32 in seen if not det and tf32]
    assert len(proof_steps) + len(timed) == len(seen), seen  # nothing in between
    return proof_steps, timed


def test_sharded_proves_in_fp64_and_times_in_the_training_dtype(group, torchrun_env, monkeypatch, tmp_path):
    demo, _ = group
    args = sharded.parse_args([*FLAGS, "--modes", "ddp,zero1", "--save-dir", str(tmp_path), "--experiment-name", "x"])
    proof_steps, timed = steps_seen(monkeypatch, sharded.Trainer, lambda: sharded.run(args, demo))
    assert proof_steps == [("ddp", torch.float64), ("zero1", torch.float64)] * 2
    # 3 timed steps each, then one more under the memory tracker
    assert timed == [("ddp", torch.float32), ("zero1", torch.float32)] * 4


def test_ddp_from_scratch_proves_in_fp64_and_times_in_the_training_dtype(group, torchrun_env, monkeypatch,
                                                                        tmp_path):
    demo, _ = group
    monkeypatch.setattr(sys, "argv", ["ddp_from_scratch.py", *FLAGS, "--modes", "bucketed,ddp",
                                      "--save-dir", str(tmp_path), "--experiment-name", "x"])
    monkeypatch.setattr(scratch, "start_group", lambda timeout: demo)
    monkeypatch.setattr(scratch, "gc_and_destroy_process_group", lambda: None)  # the fixture's group
    proof_steps, timed = steps_seen(monkeypatch, scratch.Replica, scratch.main)
    assert proof_steps == [("bucketed", torch.float64), ("ddp", torch.float64)] * 2
    assert timed == [("bucketed", torch.float32), ("ddp", torch.float32)] * 3
