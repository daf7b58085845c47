"""Chapter 05, sharded checkpoints (05-collectives/sharded_checkpoint.py): saved on 2 ranks,
each rank's file holds about half of the state; loaded on 3 ranks (and on 1), every
parameter and AdamW moment equals the saved state; the proof fails when the state
differs; a damaged checkpoint is refused in one line, by the manifest or by DCP; a
folder that is not a checkpoint stops before any work with exit status 2."""

from __future__ import annotations

import gc
import json
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from conftest import free_port, load_script, run_warm, run_folder_held, torchrun_cmd

SCRIPT = "05-collectives/sharded_checkpoint.py"
ckpt = load_script(SCRIPT)
from common.files import sha256_of  # noqa: E402
from common.model import get_config  # noqa: E402
TINY = ["--model-preset", "tiny", "--seq-length", "32", "--batch-size", "2", "--steps", "2"]
STEP = "step-00000002"


def launch(nproc, save_dir, name, *args, check=True):
    return run_warm(torchrun_cmd(nproc, SCRIPT, *TINY, "--save-dir", save_dir, "--experiment-name", name, *args),
               check=check, timeout=240)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """One run of 2 ranks that trains 2 steps and saves: (its run folder, its output)."""
    save_dir = tmp_path_factory.mktemp("dcp")
    proc = launch(2, save_dir, "saved")
    return save_dir / "saved", proc.stdout


def copy_run(run_dir: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(run_dir, tmp_path / "copy"))


def test_each_rank_writes_its_own_part(saved):
    run_dir, out = saved
    step_dir = run_dir / STEP
    assert (run_dir / "latest").read_text() == STEP and not list(run_dir.glob(".tmp-*"))
    shards = {p.name: p.stat().st_size for p in step_dir.glob("*.distcp")}
    assert sorted(shards) == ["__0_0.distcp", "__1_0.distcp"]
    whole = (run_dir / f"reference-{STEP}.pt").stat().st_size  # the state as one file
    for name, size in shards.items():  # about half each; none holds the whole
        assert 0.4 * whole < size < 0.6 * whole, (name, size, whole)
        assert re.search(rf"\| {re.escape(name)} +\| rank {name[2]} +\| +{size:,} \|", out), out
    manifest = json.loads((step_dir / "manifest.json").read_text())
    assert manifest["world_size"] == 2 and manifest["step"] == 2
    assert set(manifest["sha256"]) == {*shards, ".metadata"}
    # each rank's checksum of its own file, gathered into rank 0's manifest, is the file's
    assert manifest["sha256"] == {name: sha256_of(step_dir / name) for name in manifest["sha256"]}


def test_loaded_on_three_ranks_every_tensor_equals_the_saved_state(saved, tmp_path):
    run_dir, _ = saved
    proc = launch(3, tmp_path, "on3", "--load", run_dir)
    out = proc.stdout
    assert "OK: loaded a checkpoint written by 2 ranks on 3 ranks: every parameter and AdamW " \
           "moment equals the saved state (max difference 0," in out, out
    # the pieces DCP read: two saved halves of 176 rows, three new shards of 59, 59, 58
    assert "rows 0..87 in __0_0.distcp" in out and "rows 88..175 in __1_0.distcp" in out
    assert "rank 0 rows 0..58; rank 1 rows 59..117; rank 2 rows 118..175" in out
    assert "loss per step: 3: " in out  # it trained on from step 2, and saved step 4
    assert sorted(p.name for p in (tmp_path / "on3" / "step-00000004").glob("*.distcp")) == \
        ["__0_0.distcp", "__1_0.distcp", "__2_0.distcp"]


def test_the_proofs_own_gather_equals_torchs_on_three_ranks():
    """Over gloo with CUDA tensors torch's DTensor gather crashes (05-collectives/proof.py), so the
    proofs gather fully_shard's shards themselves there. On CPUs both work: ours must give
    what torch's gives, for shards of uneven and empty size and for the whole state."""
    proc = run_warm(torchrun_cmd(3, Path(__file__).parent / "ch05_full_state.py"))
    assert "rank 0 same: " in proc.stdout and "differs" not in proc.stdout, proc.stdout


def fresh_model(step_dir: Path):
    """Another seed and another lr than the saved run's: only loading makes them equal."""
    vocab = json.loads((step_dir / "manifest.json").read_text())["settings"]["vocab_size"]
    return ckpt.sharded_model(get_config("tiny", vocab), seed=1, lr=2e-3, device=torch.device("cpu"))


def test_loaded_on_one_rank_the_proof_passes_and_sees_one_changed_moment(saved, one_rank_group, tmp_path):
    """On 1 rank every tensor equals the saved state; against a reference with one AdamW
    moment changed by 1e-7, exactly that tensor differs."""
    step_dir = saved[0] / STEP
    model, optimizer = fresh_model(step_dir)  # only loading makes it equal (AdamW's lr too)
    reference = ckpt.reference_path(step_dir)
    assert ckpt.prove_equal(model, optimizer, reference, one_rank_group)[2] != []
    ckpt.load_sharded(model, optimizer, step_dir, one_rank_group)
    worst, compared, mismatches = ckpt.prove_equal(model, optimizer, reference, one_rank_group)
    assert (worst, mismatches) == (0.0, []) and compared == 3 * 21 + 21  # params, 2 moments, steps
    state = torch.load(reference, weights_only=True)
    key = "layers.1.self_attn.o_proj.weight"
    state["optim"]["state"][key]["exp_avg"][3, 5] += 1e-7
    torch.save(state, tmp_path / "changed.pt")
    worst, _, mismatches = ckpt.prove_equal(model, optimizer, tmp_path / "changed.pt", one_rank_group)
    assert 5e-8 < worst < 2e-7 and mismatches == [f"optim.state.{key}.exp_avg: max difference {worst:.3g}"]
    assert (ckpt.ranks(1), ckpt.ranks(3)) == ("1 rank", "3 ranks")  # as the script says where it loaded


def test_a_shard_dcp_cannot_read_is_one_line_not_a_traceback(saved, one_rank_group, tmp_path, capsys):
    """The manifest passed (as if the file went missing after the check): DCP raises
    CheckpointException, a BaseException, and the run still stops with one line."""
    step_dir = copy_run(saved[0], tmp_path) / STEP
    (step_dir / "__0_0.distcp").unlink()
    model, optimizer = fresh_model(step_dir)
    with pytest.raises(SystemExit) as stop:
        ckpt.load_sharded(model, optimizer, step_dir, one_rank_group)
    err = capsys.readouterr().err
    assert stop.value.code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith(f"error: checkpoint {step_dir} cannot be loaded: rank 0: FileNotFoundError") \
        and "__0_0.distcp" in err, err


@pytest.mark.parametrize("room", [0.5, 1.5], ids=["reference-write", "dcp-write"])
def test_a_full_disk_during_the_save_is_one_line_and_leaves_nothing(saved, one_rank_group, small_disk, capsys, room):
    """A disk with room for half the state (the proof's reference fails) or one and a half
    (the reference fits, DCP's shard does not): exit status 1, one line naming the cause,
    and the run folder as it was (no .tmp- folder, no reference without its checkpoint)."""
    step_dir = saved[0] / STEP
    model, optimizer = fresh_model(step_dir)
    ckpt.load_sharded(model, optimizer, step_dir, one_rank_group)  # AdamW's moments too
    whole = ckpt.reference_path(step_dir).stat().st_size
    run_dir = small_disk(int(room * whole)) / "run"
    run_dir.mkdir()
    with pytest.raises(SystemExit) as stop:
        ckpt.save_sharded(model, optimizer, run_dir / "step-00000004", {}, 4, one_rank_group)
    unraisable = []  # what a collection reports: at exit, Python prints it on stderr
    previous, sys.unraisablehook = sys.unraisablehook, unraisable.append
    try:
        gc.collect()
    finally:
        sys.unraisablehook = previous
    assert not unraisable, [f"{u.object!r}: {u.exc_value!r}" for u in unraisable]
    err = capsys.readouterr().err
    assert stop.value.code == 1 and len(err.splitlines()) == 1, err
    assert err.startswith(f"error: disk full while saving into {run_dir} ("), err
    assert "nothing was saved" in err and "Traceback" not in err, err
    assert list(run_dir.iterdir()) == []


def test_a_deleted_shard_is_refused_by_the_manifest(saved, tmp_path, monkeypatch, capsys):
    """The script's main() in this process, as torchrun would start one rank of it (its
    variables set; main() makes the process group itself): no worker start-up to pay,
    and the same path from flags to the verdict."""
    run_dir = copy_run(saved[0], tmp_path)
    (run_dir / STEP / "__1_0.distcp").unlink()
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(sys, "argv", [SCRIPT, *TINY, "--save-dir", str(tmp_path), "--experiment-name", "x",
                                      "--load", str(run_dir)])
    with pytest.raises(SystemExit) as stop:  # fail(): one line and exit status 2, no traceback
        ckpt.main()
    assert not dist.is_initialized()  # main() took its process group down on the way out
    out, err = capsys.readouterr()
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert stop.value.code == 2 and errors == [f"error: checkpoint {run_dir / STEP} is damaged: "
                                               f"__1_0.distcp is missing; nothing was loaded"], err
    assert len(err.splitlines()) == 1 and not (tmp_path / "x").exists()


@pytest.mark.parametrize("flags, message", [
    (["--load", "{tmp}"], "is not a sharded checkpoint"),
    (["--load", "{run}", "--model-preset", "small"], "was saved with --model-preset tiny, this run has small"),
])
def test_bad_input_stops_before_any_work(saved, tmp_path, capsys, flags, message):
    """The checks run inside parse_args, before torchrun's variables are even looked at."""
    flags = [f.format(tmp=tmp_path, run=saved[0]) for f in flags]
    with pytest.raises(SystemExit) as stop:
        ckpt.parse_args(["--save-dir", str(tmp_path / "out"), *flags])
    out, err = capsys.readouterr()
    assert stop.value.code == 2 and out == "" and len(err.splitlines()) == 1 and message in err, err
    assert not (tmp_path / "out").exists()


def test_compare_sees_every_kind_of_difference():
    saved = {"model": {"w": torch.zeros(2, 3)}, "optim": {"param_groups": [{"lr": 1e-3, "params": ["w"]}]}}
    same = {"model": {"w": torch.zeros(2, 3)}, "optim": {"param_groups": [{"lr": 1e-3, "params": ["w"]}]}}
    assert ckpt.compare(same, saved) == (0.0, 1, [])
    same["model"]["w"][1, 2] = 2**-30
    worst, _, mismatches = ckpt.compare(same, saved)
    assert worst == 2**-30 and mismatches == ["model.w: max difference 9.31e-10"]
    assert ckpt.compare({"model": {"w": torch.zeros(3, 2)}, "optim": saved["optim"]}, saved)[2] == \
        ["model.w: (3, 2) torch.float32 vs (2, 3) torch.float32"]
    assert ckpt.compare({"model": {}, "optim": saved["optim"]}, saved)[2] == ["model.w: missing after loading"]
    other_lr = {"model": saved["model"], "optim": {"param_groups": [{"lr": 2e-3, "params": ["w"]}]}}
    assert ckpt.compare(other_lr, saved)[2] == ["optim.param_groups.0.lr: 0.002 vs 0.001"]


def test_a_second_job_with_the_same_name_is_refused_not_colliding(tmp_path):
    """The run folder is held from the start: a second job with the same
    --experiment-name stops on every rank with the one line, instead of writing into the
    first one's .tmp- folders (both then failed, with a "free some space" line)."""
    with run_folder_held(tmp_path / "same") as holder:
        proc = run_warm(torchrun_cmd(2, SCRIPT, *TINY, "--save-dir", tmp_path, "--experiment-name", "same"),
                   check=False)
        assert proc.returncode != 0, proc.stderr[-3000:]  # torchrun's status: 1 for any failed rank
        errors = [line for line in proc.stderr.splitlines() if "error: " in line]
        assert errors and all(f"run folder '{tmp_path / 'same'}' is in use by pid {holder.pid} on " in e
                              for e in errors), errors
        assert sorted(p.name for p in (tmp_path / "same").iterdir()) == [".owner"]
