"""Chapter 03, the proof: DDP with W processes of batch B trains exactly what chapter 01
trains with batch W*B (same losses, same weights), with or without gradient
accumulation, on one "node" or two; plain python is world size 1; only rank 0 writes
and prints."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import REPO, SMALL_CORPUS_FLAGS, TINY, free_port, python_cmd, read_json, \
    read_jsonl, run_warm, shuffled_epochs, small_corpus, start, torchrun_cmd, training_order
from pages import readme_command

SCRIPT = "03-ddp/train_llm.py"
CH01 = "01-single-gpu/train_llm.py"
STEPS = 20
RTOL = 1e-5  # per-step loss and gradient norm, fp32
# Weights: one step on different data moves every tensor by about 1e-2 of its norm, so
# these bounds are far below any real mismatch (rounding measures ~2e-6 and ~3e-5).
WEIGHT_NORM_RTOL = 5e-5   # per tensor: |a - b| / |b| (Frobenius norms)
WEIGHT_ATOL = 2e-4        # per element: a fifth of one Adam step at the peak lr 1e-3


def train_args(save_dir, name, batch, *extra, steps=STEPS):
    """The tiny settings with 32-token sequences: what is compared (losses, gradient
    norms, weights) depends on the batch and the steps, not on the sequence length."""
    return [*TINY, "--seq-length", 32, "--batch-size", batch, "--max-steps", steps,
            "--save-dir", save_dir, "--experiment-name", name, *extra]


def assert_same_training(run_dir, ref_dir):
    """Same per-step losses and gradient norms (the norm before clipping: it would show
    gradients summed instead of averaged, which AdamW itself hides) and the same final
    weights. Weights are compared per tensor and per element with an absolute bound:
    Adam divides by the root of its second moment, so an element whose gradient nearly
    cancels turns float rounding into a visible (still tiny) difference."""
    got, ref = read_jsonl(run_dir / "metrics.jsonl"), read_jsonl(ref_dir / "metrics.jsonl")
    assert [r["step"] for r in got] == [r["step"] for r in ref] == list(range(1, STEPS + 1))
    for key in ("loss", "grad_norm"):
        assert [r[key] for r in got] == pytest.approx([r[key] for r in ref], rel=RTOL, abs=0), key
    a = torch.load(run_dir / "model.pt", weights_only=True)
    b = torch.load(ref_dir / "model.pt", weights_only=True)
    assert a.keys() == b.keys()
    norm_rel = {k: ((a[k] - b[k]).norm() / b[k].norm()).item() for k in b}
    assert max(norm_rel.values()) <= WEIGHT_NORM_RTOL, norm_rel
    for k in b:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=WEIGHT_ATOL, msg=k)
    loss_rel = max(abs(x["loss"] - y["loss"]) / y["loss"] for x, y in zip(got, ref))
    max_abs = max((a[k] - b[k]).abs().max().item() for k in b)
    print(f"\n{run_dir.name} vs {ref_dir.name}: loss rel diff {loss_rel:.1e}, weights: "
          f"norm rel diff {max(norm_rel.values()):.1e}, max abs diff {max_abs:.1e}")


@pytest.fixture(scope="module")
def save_dir(tmp_path_factory):
    """One folder for the chapter 01 references and the DDP runs that compare to them."""
    return tmp_path_factory.mktemp("ch03")


@pytest.fixture(scope="module")
def ch01_b16(save_dir):
    """The reference: chapter 01 with global batch 16."""
    run_warm(python_cmd(CH01, *train_args(save_dir, "ch01-b16", 16)))
    return save_dir / "ch01-b16"


@pytest.fixture(scope="module")
def ddp(save_dir):
    """The README's command: 2 processes x batch 8, its ranks started warm (the command
    as written, with the real torchrun: test_readmes.py)."""
    proc = run_warm([*readme_command("03-ddp/README.md", "torchrun --standalone --nproc-per-node=2 03-ddp/train_llm.py"),
                *train_args(save_dir, "ddp-2x8", 8)])
    return proc, save_dir / "ddp-2x8"


@pytest.fixture(scope="module")
def accum(save_dir):
    """The README's plain python (world size 1), batch 8 x grad-accum 2."""
    proc = run_warm([*readme_command("03-ddp/README.md", "python 03-ddp/train_llm.py"),
                *train_args(save_dir, "accum-1x8x2", 8, "--grad-accum", 2)])
    return proc, save_dir / "accum-1x8x2"


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    """Two torchrun launchers (two processes each, batch 2 x grad-accum 2) meeting through
    a c10d rendezvous, as two machines would: ranks 0-1 on one, 2-3 on the other, each
    with a local rank 0; global batch 4 x 2 x 2 = 16. They also checkpoint activations:
    recomputing each layer in backward, under DDP and no_sync, must still train exactly
    what chapter 01 trains without it. (Two real network hosts, one process each:
    test_two_hosts.py.)"""
    save_dir = tmp_path_factory.mktemp("ch03-nodes")
    port = free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=2",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id=nodes-{port}",
           str(REPO / SCRIPT), *map(str, train_args(save_dir, "nodes-4x2x2", 2, "--grad-accum", 2,
                                                   "--activation-checkpointing"))]
    logs_dir = tmp_path_factory.mktemp("ch03-nodes-logs")
    logs = [logs_dir / f"node{i}.log" for i in range(2)]
    nodes = [start(cmd, log) for log in logs]  # the real torchrun, twice
    statuses = [node.wait(timeout=300) for node in nodes]
    assert statuses == [0, 0], "\n".join(log.read_text()[-4000:] for log in logs)
    return [log.read_text() for log in logs], save_dir


def test_ddp_equals_single_process_with_the_global_batch(ddp, ch01_b16):
    proc, run_dir = ddp
    summary = read_json(run_dir / "summary.json")
    assert (summary["world_size"], summary["backend"], summary["global_batch_size"]) == (2, "gloo", 16)
    assert_same_training(run_dir, ch01_b16)


def test_on_4_ranks_ddp_equals_single_process_too(save_dir, ch01_b16):
    """4 processes x batch 4: each rank's share of the global batch of 16 is a quarter,
    and the all-reduce averages four partial gradients, added in another order than one
    process adds them; still the same training, within the same bounds as on 2 ranks."""
    run_warm(torchrun_cmd(4, SCRIPT, *train_args(save_dir, "ddp-4x4", 4)))
    summary = read_json(save_dir / "ddp-4x4" / "summary.json")
    assert (summary["world_size"], summary["global_batch_size"]) == (4, 16)
    assert_same_training(save_dir / "ddp-4x4", ch01_b16)


def test_grad_accumulation_equals_the_larger_batch(accum, ch01_b16):
    assert_same_training(accum[1], ch01_b16)


@pytest.mark.launch
def test_two_nodes_with_grad_accumulation_equal_the_global_batch(two_nodes, ch01_b16):
    stdouts, save_dir = two_nodes
    assert [p.name for p in save_dir.iterdir()] == ["nodes-4x2x2"]
    assert len(list(save_dir.rglob("summary.json"))) == 1
    summary = read_json(save_dir / "nodes-4x2x2" / "summary.json")
    assert (summary["world_size"], summary["global_batch_size"]) == (4, 16)
    assert summary["activation_checkpointing"]
    assert sum(out.count("outputs in") for out in stdouts) == 1   # rank 0's node only
    assert_same_training(save_dir / "nodes-4x2x2", ch01_b16)


def test_each_rank_trains_on_its_share_of_a_fresh_shuffle_every_epoch(tmp_path):
    """2 ranks x batch 2 over three epochs of a 13-sample corpus (3 steps each): rank r
    reads every second sample of randperm(seed + epoch) from r, epoch after epoch, as
    chapter 01 reads the whole of it. Without sampler.set_epoch(epoch) every epoch would
    repeat epoch 0's order on both ranks, and chapter 03 would still equal chapter 01
    within one epoch, where the other tests of this file run."""
    steps, seed = 7, 5
    orders = training_order(tmp_path, lambda *a: torchrun_cmd(2, *a), SCRIPT, *train_args(
        tmp_path, "order", 2, "--dataset-name", small_corpus(tmp_path), *SMALL_CORPUS_FLAGS,
        "--seed", seed, "--val-batches", 1, steps=steps))
    n = read_json(tmp_path / "order" / "summary.json")["data"]["train_samples"]
    expected = shuffled_epochs(n, seed, epochs=3, batch=2, world=2)
    assert n == 13 and orders == [rank[: steps * 2] for rank in expected]


def test_plain_python_is_world_size_1(accum):
    summary = read_json(accum[1] / "summary.json")
    assert (summary["world_size"], summary["backend"], summary["launcher"]) == (1, None, "python")
    assert (summary["global_batch_size"], summary["grad_accum"]) == (16, 2)


def test_only_rank_0_writes_and_prints(ddp):
    proc, run_dir = ddp
    assert proc.stdout.count("| metric ") == 1 and proc.stdout.count("outputs in") == 1
    assert "[rank 1]" not in proc.stdout + proc.stderr  # rank 1 logs only trouble
    assert "over 2 batches" in proc.stdout  # TINY's --val-batches 2 in all, not 2 per rank
    assert sorted(p.name for p in run_dir.iterdir()) == [".owner", "metrics.jsonl", "model.pt", "summary.json"]
    steps = [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")]
    assert steps == list(range(1, STEPS + 1))  # one writer: every step once


def test_slurm_script_is_valid_bash_and_launches_what_the_readme_says(tmp_path):
    """`bash -n`, then a dry run with stand-ins for getent, hostname and srun (srun runs
    its command as node 0, then as node 1; torchrun prints what it was given): one srun
    with the CPUs passed on, the rendezvous at the first node's own interface address
    (its host name resolves to a loopback address here) on a port of the job's own, each
    node's own address as --local-addr, is_host=1 on the first node only, and an early
    SIGTERM."""
    script = REPO / "03-ddp" / "slurm_ddp.sbatch"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    assert "#SBATCH --signal=TERM@120" in script.read_text()
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stand_ins = {"getent": 'echo "127.0.1.1 STREAM $2"',
                 "hostname": 'test "$1" = -I && echo "${NODE_ADDR:-10.0.0.1} 172.17.0.1"',
                 "srun": 'echo "srun $1"; shift\nfor n in 0 1; do SLURM_NODEID=$n NODE_ADDR=10.0.0.$((n + 1)) "$@"; done',
                 "torchrun": 'echo "torchrun $*"'}
    for name, body in stand_ins.items():
        (bin_dir / name).write_text(f"#!/bin/bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "123456",
           "SLURM_JOB_NODELIST": "node-[a-b]", "SLURM_NNODES": "2", "SLURM_CPUS_PER_TASK": "32"}
    out = subprocess.run(["bash", str(script)], cwd=REPO, env=env, capture_output=True,
                         text=True, check=True).stdout.splitlines()
    assert out[0] == "srun --cpus-per-task=32"
    common = ("torchrun --nnodes=2 --nproc-per-node=8 --rdzv-id=123456 --rdzv-backend=c10d "
              "--rdzv-endpoint=10.0.0.1:23456 ")
    assert out[1].startswith(common + "--local-addr=10.0.0.1 --rdzv-conf=is_host=1 03-ddp/train_llm.py "
                             "--experiment-name ddp-123456")
    assert out[2].startswith(common + "--local-addr=10.0.0.2 03-ddp/train_llm.py --experiment-name ddp-123456")


def probe(setup: str, report: str) -> str:
    """A wrapper script: `setup` (what it patches), then the script named by its first
    argument, run as `python script` runs it, then `report` printed by rank 0, after an
    exit from inside the script (sys.exit) too."""
    return f"""import json, os, runpy, sys
{setup}
sys.argv = sys.argv[1:]
sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
finally:
    if os.environ["RANK"] == "0":
        print({report}, flush=True)
"""


DYNAMO_PROBE = probe("""
import torch
from torch.optim.optimizer import register_optimizer_step_post_hook
graphs, first_step = [], []
def counting(gm, example_inputs):  # a backend that records each graph it gets and runs it as traced
    graphs.append(len(gm.graph.nodes))
    return gm.forward
real_compile = torch.nn.Module.compile
# fullgraph: a graph break is an error; the counting backend: no code generation
torch.nn.Module.compile = lambda self, *a, **k: real_compile(self, *a, **{**k, "backend": counting,
                                                                          "fullgraph": True})
register_optimizer_step_post_hook(lambda *_: first_step or first_step.append(len(graphs)))""",
                     '"DYNAMO", json.dumps({"graphs_in_step_1": first_step[0] if first_step else None})')


def test_compile_under_ddp_is_one_graph_cut_by_ddps_optimizer(tmp_path):
    """--compile compiles the module before DDP wraps it: dynamo traces it whole, with no
    graph break (fullgraph=True would raise at one), and DDP's optimizer cuts that one
    graph at the buckets' borders, so the all-reduces still overlap backward: in step 1
    the backend gets the forward in pieces, one per bucket (2 for the tiny model, whose
    first bucket is capped at 1 MB; one graph without DDP). The probe's backend only
    counts the graphs (no code generation: seconds, not a minute); that the compiled
    model trains what eager trains is chapter 01's test."""
    wrapper = tmp_path / "probe.py"
    wrapper.write_text(DYNAMO_PROBE)
    proc = run_warm(torchrun_cmd(2, wrapper, REPO / SCRIPT, *train_args(tmp_path, "compiled", 4, "--compile",
                                                                        steps=3)))
    found = [json.loads(line.split(" ", 1)[1]) for line in proc.stdout.splitlines() if line.startswith("DYNAMO ")]
    assert found and (found[0]["graphs_in_step_1"] or 0) >= 2, proc.stdout[-2000:]


COUNT_COLLECTIVES = probe("""
import torch.distributed as dist
calls = []
real = dist.all_reduce
def counted(tensor, *args, **kwargs):
    calls.append(1)
    return real(tensor, *args, **kwargs)
dist.all_reduce = counted""", '"ALL_REDUCE_CALLS", len(calls)')


@pytest.mark.parametrize("form", ["packed", "padded"])
def test_packed_steps_send_no_token_count(tmp_path, form):
    """Packed data has a known token count per step: nothing to send. Padded data sums
    its count over the ranks once per step. Counted from dist.all_reduce calls over 6
    steps, logging only at the last one (one all-reduce for the loss, one for the
    validation); DDP's gradient all-reduces do not go through dist.all_reduce."""
    wrapper = tmp_path / "count.py"
    wrapper.write_text(COUNT_COLLECTIVES)
    extra = ["--padded"] if form == "padded" else []
    args = train_args(tmp_path, form, 4, "--log-freq", 100, *extra, steps=6)
    proc = run_warm(torchrun_cmd(2, wrapper, REPO / SCRIPT, *args))
    calls = [int(line.split()[-1]) for line in proc.stdout.splitlines()
             if line.startswith("ALL_REDUCE_CALLS")]
    assert calls == [2 + (6 if form == "padded" else 0)], proc.stdout[-2000:]


COUNT_DDP_ALL_REDUCES = probe("""
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel
calls = []
real_init = DistributedDataParallel.__init__
def init(self, *args, **kwargs):
    real_init(self, *args, **kwargs)
    def counted(state, bucket):  # DDP's own averaging, counted
        calls.append(1)
        return allreduce_hook(state, bucket)
    self.register_comm_hook(None, counted)
DistributedDataParallel.__init__ = init""", '"DDP_ALL_REDUCES", len(calls)')


def test_accumulation_all_reduces_only_the_last_micro_batch(tmp_path):
    """With --grad-accum 2, DDP all-reduces its buckets once per step, as with 1: the
    first micro-batch only accumulates (require_backward_grad_sync, what no_sync sets).
    Averaging every micro-batch would give the same numbers (the other tests cannot
    tell), at twice the traffic. Counted by a communication hook over 3 steps."""
    wrapper = tmp_path / "count.py"
    wrapper.write_text(COUNT_DDP_ALL_REDUCES)
    counts = []
    for accum in (1, 2):
        proc = run_warm(torchrun_cmd(2, wrapper, REPO / SCRIPT, *train_args(
            tmp_path, f"accum{accum}", 2, "--grad-accum", accum, "--val-batches", 1, steps=3)))
        counts += [int(line.split()[-1]) for line in proc.stdout.splitlines()
                   if line.startswith("DDP_ALL_REDUCES")]
    assert len(counts) == 2 and counts[0] == counts[1] >= 3, counts


def test_a_full_disk_at_the_final_save_stops_every_rank_with_its_one_line(small_disk):
    """Rank 0's model.pt does not fit a 2 MB disk: every rank hears why (no rank left
    waiting, no traceback) and no truncated model.pt stays behind."""
    disk = small_disk(2 << 20)
    proc = run_warm(torchrun_cmd(2, SCRIPT, *train_args(disk, "full", 4, steps=2)), check=False)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert errors and all(f"disk full while saving {disk / 'full' / 'model.pt'}" in e for e in errors), errors
    assert {p.name for p in (disk / "full").iterdir()} == {".owner", "metrics.jsonl"}
