"""common.resume on real process groups (2 gloo ranks, spawned here): rank 0 decides which
checkpoints to try even when another rank's disk lists others (or none); a candidate
that fails on any rank leaves every rank's model and optimizer exactly as they were;
every rank's RNG state is gathered. Also: iterating the chapters' DataLoader draws
nothing from the global generator."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from common.resume import load_newest, run_settings
from conftest import free_port


class Log:
    def __init__(self):
        self.lines = []

    def warning(self, fmt, *args):
        self.lines.append(fmt % args)


def tiny_model():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, optimizer


def make_checkpoint(folder: Path, value: float, settings: dict):
    """A checkpoint folder as chapter 04 writes it: state.pt and its manifest."""
    from common.durable import write_manifest

    folder.mkdir(parents=True)
    model, optimizer = tiny_model()
    with torch.no_grad():
        model.weight.fill_(value)
    model(torch.ones(1, 4)).sum().backward()
    optimizer.step()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "value": value},
               folder / "state.pt")
    write_manifest(folder, {"settings": settings})


def read(path):
    return torch.load(path / "state.pt", weights_only=True)


def load(state, path, model, optimizer):
    model.load_state_dict(state["model"])
    if dist.get_rank() == 1 and state["value"] == 2.0:
        raise RuntimeError("rank 1 cannot load this one")  # after the model changed
    optimizer.load_state_dict(state["optimizer"])


def worker(rank, port, root, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE="2", LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    settings = {"lr": 1.0}
    model, optimizer = tiny_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    # rank 0 lists two checkpoints; rank 1 (another machine's disk, say) lists none
    candidates = [root / "step-2", root / "step-1"] if rank == 0 else []
    log = Log()
    state, path = load_newest(candidates, read, load, model, optimizer, rank=rank,
                              settings=settings, log=log)
    results[rank] = {"value": state["value"], "path": str(path), "warnings": log.lines,
                     "weight": model.weight.detach().clone(), "adam_steps": len(optimizer.state)}
    # a candidate that fails everywhere: model and optimizer exactly as they were
    fresh_model, fresh_optimizer = tiny_model()
    try:
        load_newest([root / "step-2"] if rank == 0 else [], read, load, fresh_model,
                    fresh_optimizer, rank=rank, settings=settings, log=Log())
    except SystemExit as e:
        results[f"exit{rank}"] = e.code
    results[f"unchanged{rank}"] = (
        all(torch.equal(v, before[k]) for k, v in fresh_model.state_dict().items())
        and len(fresh_optimizer.state) == 0)
    dist.destroy_process_group()


def test_rank_0_decides_and_a_failed_candidate_changes_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr("common.errors.time.sleep", lambda s: None)
    make_checkpoint(tmp_path / "step-1", 1.0, {"lr": 1.0})
    make_checkpoint(tmp_path / "step-2", 2.0, {"lr": 1.0})
    results = mp.Manager().dict()
    mp.spawn(worker, args=(free_port(), tmp_path, results), nprocs=2, join=True)
    # step-2 fails on rank 1, so both ranks fall back to step-1, as rank 0 listed
    for rank in (0, 1):
        r = results[rank]
        assert r["value"] == 1.0 and r["path"] == str(tmp_path / "step-1")
        assert torch.equal(r["weight"], results[0]["weight"]) and r["adam_steps"] == 2
    assert any("rank 1 cannot load this one" in w for w in results[0]["warnings"])
    # only candidate fails: every rank stops (exit 2), model and optimizer as built
    assert results["exit0"] == results["exit1"] == 2
    assert results["unchanged0"] and results["unchanged1"]


def test_settings_are_checked_before_anything_is_loaded(tmp_path, capsys, monkeypatch):
    """One process: another run's checkpoint stops the run with the flag named, and the
    model never sees its weights."""
    make_checkpoint(tmp_path / "step-1", 1.0, {"lr": 1.0})
    model, optimizer = tiny_model()
    before = model.weight.detach().clone()
    calls = []
    with pytest.raises(SystemExit) as exit_:
        load_newest([tmp_path / "step-1"], lambda p: calls.append(p), load, model, optimizer,
                    rank=0, settings={"lr": 2.0}, log=Log())
    assert exit_.value.code == 2 and not calls
    assert "other settings (--lr 1.0 -> 2.0)" in capsys.readouterr().err
    assert torch.equal(model.weight, before)


def test_run_settings_name_the_flags_the_data_and_the_format():
    import argparse

    from common.resume import RUN_DEFINING_FLAGS
    args = argparse.Namespace(**{k: k for k in RUN_DEFINING_FLAGS})
    s = run_settings(args, 16, "abc", 2)
    assert s["global batch"] == 16 and s["data fingerprint"] == "abc" and s["format version"] == 2
    assert {"model_preset", "vocab_size", "seq_length", "lr", "seed"} <= set(s)


def test_iterating_the_loader_leaves_the_global_generator_alone():
    """Each iter() over a DataLoader draws a base seed; the chapters give it its own
    generator, so a resumed run's global RNG stream is not shifted by one draw."""
    from torch.utils.data import DataLoader

    data = list(range(16))
    torch.manual_seed(0)
    before = torch.get_rng_state()
    iter(DataLoader(data, batch_size=4, generator=torch.Generator().manual_seed(0)))
    assert torch.equal(torch.get_rng_state(), before)
    iter(DataLoader(data, batch_size=4))  # without one, the global generator moves
    assert not torch.equal(torch.get_rng_state(), before)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__]))
