"""Each proof fails whenever the code it proves is wrong. A named bug is injected into a
copy of the chapter's scripts (the real files are never touched); the copy's proof runs
as the page runs it, its ranks started warm, on the tiny preset for one step (two where
the bug can only show in the second); it must exit 1 with one FAILED line that says what
differs, at the step where the bug first acts. Two more bugs target the checks of chapter 06's
pipeline (its order of sends and receives, and what it keeps), and one the comparison
of chapter 06's training with chapter 01's. tests/README.md lists
which proof catches which bug. Each bug's text must be found once in the current code, so a change to the
code cannot leave a mutant silently unapplied."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

from ch06_runs import (chapter_01_scenario, chapter_06_scenario, completes, kept_off_plan, record_p2p,
                       unlike_chapter_01)
from conftest import REPO, read_json, run_warm, torchrun_cmd


@dataclass(frozen=True)
class Mutant:
    name: str  # the bug, as the test's id
    file: str  # the chapter file it goes into
    code: str  # the code as it is: found exactly once in the file
    bug: str  # what replaces it
    ranks: int  # processes of the proof's launch
    proof: tuple  # the proof's script and arguments
    says: str  # what its FAILED line must say


PROVE = ("06-model-parallel/prove.py", "--model-preset", "tiny", "--seq-length", "16", "--batch-size", "4",
         "--proof-steps", "1", "--layouts")
DDP = ("05-collectives/ddp_from_scratch.py", "--model-preset", "tiny", "--seq-length", "16", "--batch-size", "2",
       "--steps", "1", "--timing-warmup", "0", "--proof-steps", "1", "--modes")
SHARDED = ("05-collectives/sharded_from_scratch.py", "--model-preset", "tiny", "--seq-length", "16",
           "--batch-size", "2", "--steps", "2", "--timing-warmup", "1", "--proof-steps", "1", "--modes")

MUTANTS = [
    # chapter 06's proof: every layout against chapter 01's step, in fp64
    Mutant("loss-scaled", "06-model-parallel/train_llm.py",
           'ignore_index=IGNORE_INDEX,\n                           reduction="sum")',
           'ignore_index=IGNORE_INDEX,\n                           reduction="sum") * 2',
           2, (*PROVE, "pp2-1f1b-scratch"), "pp2-1f1b-scratch: step 1: the gradient of"),
    Mutant("dp-gradients-summed", "06-model-parallel/train_llm.py",
           "torch.cat([g.reshape(-1) for g in grads]).div_(dp)", "torch.cat([g.reshape(-1) for g in grads])",
           4, (*PROVE, "dp2xtp2-scratch"), "dp2xtp2-scratch: step 1: the gradient of"),
    Mutant("g-all-reduce-missing", "06-model-parallel/tensor_parallel.py",
           "        x = x.clone()  # a copy: the all-reduce writes in place, and x is the caller's\n"
           "        dist.all_reduce(x, group=group)\n",
           "        x = x.clone()\n",
           2, (*PROVE, "tp2-scratch"), "tp2-scratch: step 1: the loss differs from chapter 01's"),
    Mutant("f-all-reduce-missing", "06-model-parallel/tensor_parallel.py",
           "        dist.all_reduce(grad, group=ctx.group)\n", "",
           2, (*PROVE, "tp2-scratch"), "tp2-scratch: step 1: the gradient of"),
    Mutant("norm-weight-counted-on-every-tp-rank", "06-model-parallel/train_llm.py",
           'if is_tp_sharded(p) or not mesh or mesh.get_local_rank("tp") == 0:', "if True:",
           2, (*PROVE, "tp2-scratch"), "tp2-scratch: step 1: the clipped gradient of"),
    Mutant("wrong-shard-offset", "06-model-parallel/tensor_parallel.py",
           "    start = min(rank * per, size)\n", "    start = 0\n",
           2, (*PROVE, "tp2-scratch"), "tp2-scratch: step 1: the loss differs from chapter 01's"),
    Mutant("target-logit-from-every-tp-rank", "06-model-parallel/tensor_parallel.py",
           "reduce_from_tp(target_logit * mine, group)", "reduce_from_tp(target_logit, group)",
           2, (*PROVE, "tp2-scratch"), "tp2-scratch: step 1: the loss differs from chapter 01's"),
    Mutant("micro-batch-losses-divided-by-m", "06-model-parallel/pipeline_parallel.py",
           "loss = self.forward(i, micro_batches[i], loss_fn, phase)",
           "loss = self.forward(i, micro_batches[i], lambda o, t: loss_fn(o, t) / len(micro_batches), phase)",
           2, (*PROVE, "pp2-1f1b-scratch"), "pp2-1f1b-scratch: step 1: the loss differs from chapter 01's"),
    Mutant("gpipe-backwards-reversed", "06-model-parallel/pipeline_parallel.py",
           '[("B", i) for i in range(m)]\n', '[("B", i) for i in reversed(range(m))]\n',
           2, (*PROVE, "pp2-gpipe-scratch,pp2-1f1b-scratch"),
           "pp2-gpipe-scratch: step 1: GPipe's weights differ from 1F1B's"),
    Mutant("nan-in-a-clipped-gradient", "06-model-parallel/train_llm.py",
           "        local_grad(p).mul_(coef.to(p.grad.dtype))\n    return total\n",
           "        local_grad(p).mul_(coef.to(p.grad.dtype))\n    local_grad(params[-1]).view(-1)[0] = float('nan')\n"
           "    return total\n",
           2, (*PROVE, "pp2-1f1b-scratch"), "pp2-1f1b-scratch: step 1: the clipped gradient of "),
    # chapter 05's proofs: every mode against DDP's step, in fp64
    Mutant("naive-gradients-summed", "05-collectives/ddp_from_scratch.py",
           "            p.grad.mul_(self.scale)\n", "",
           2, (*DDP, "naive,ddp"), "naive: step 1: an averaged gradient differs from DDP's"),
    Mutant("zero3-reduce-scatter-skipped", "05-collectives/sharded_from_scratch.py",
           "self.comm.reduce_scatter(self.grad_shard, self.grad_full.div_(self.comm.world))",
           "self.grad_shard.copy_(self.grad_full.div_(self.comm.world)[self.lo:self.lo + self.grad_shard.numel()])",
           2, (*SHARDED, "ddp,zero3"), "zero3: step 1: an averaged gradient differs from DDP's"),
    Mutant("zero1-wrong-shard-offset", "05-collectives/sharded_from_scratch.py",
           "lo = self.lo = rank * size", "lo = self.lo = 0",
           2, (*SHARDED, "ddp,zero1"), "zero1: step 1: an averaged gradient differs from DDP's"),
    Mutant("zero1-gradients-not-zeroed", "05-collectives/sharded_from_scratch.py",
           "    def before_forward(self):\n        self.flat.grad_full.zero_()\n",
           "    def before_forward(self):\n        pass\n",
           2, (*SHARDED, "ddp,zero1", "--proof-steps", "2"), "zero1: step 2: an averaged gradient differs from DDP's"),
    Mutant("nan-in-a-loss", "05-collectives/ddp_from_scratch.py",
           "            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1), ignore_index=IGNORE_INDEX)\n",
           "            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1), ignore_index=IGNORE_INDEX)\n"
           "            loss = loss * float('nan') if self.mode == 'bucketed' else loss\n",
           2, (*DDP, "bucketed,ddp"), "bucketed: step 1: the loss is not finite (nan)"),
]


def inject(mutant: Mutant, root: Path) -> Path:
    """A copy of the mutant's chapter folder under `root`, with the bug in it."""
    source = REPO / mutant.file
    folder = root / source.parent.name
    shutil.copytree(source.parent, folder, ignore=shutil.ignore_patterns("*.md", "__pycache__"))
    text = source.read_text()
    assert text.count(mutant.code) == 1, f"{mutant.name}: its code is not found once in {mutant.file}"
    (folder / source.name).write_text(text.replace(mutant.code, mutant.bug))
    return root


@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda m: m.name)
def test_the_proof_that_targets_a_bug_fails(mutant, tmp_path):
    copy = inject(mutant, tmp_path / "copy")
    script, *args = mutant.proof
    proc = run_warm(torchrun_cmd(mutant.ranks, copy / script, *args, "--save-dir", tmp_path,
                                 "--experiment-name", "mutant"), check=False, timeout=300)
    failed = [line for line in proc.stderr.splitlines() if line.startswith("FAILED: ")]
    assert proc.returncode == 1 and len(failed) == 1, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert mutant.says in failed[0], failed[0]
    if script.endswith("prove.py"):  # the bug lands far above the tolerance, or is a NaN: nothing near it
        result = read_json(tmp_path / "mutant" / "prove.json")
        worst = max(max(r[k] for k in ("loss", "grads", "clipped", "weights")) for r in result["layouts"].values())
        assert "not finite" in failed[0] or "GPipe" in failed[0] or worst > 1e4, result


# chapter 06's pipeline: the order of its sends and receives, and what it keeps
UNPAIRED = Mutant("sends-apart-from-their-receive", "06-model-parallel/pipeline_parallel.py",
                  "            for work in dist.batch_isend_irecv(ops):\n                work.wait()\n",
                  "            works = [w for op in ops for w in dist.batch_isend_irecv([op])]  # each op alone\n"
                  "            for work in reversed(works):  # the receive first, then the sends: as isend, then recv\n"
                  "                work.wait()\n",
                  4, (), "")
KEPT = Mutant("sent-tensors-kept-to-the-end", "06-model-parallel/pipeline_parallel.py",
              "        self.outbox = []  # sent: the tensors are no longer ours to keep\n",
              "        self.sent = [*getattr(self, 'sent', []), *self.outbox]\n        self.outbox = []\n",
              2, ("06-model-parallel/measure.py", "--model-preset", "tiny", "--seq-length", "16", "--microbatches",
                  "1,4", "--steps", "1", "--warmup", "0"), "")


def test_sends_apart_from_their_receive_fail_the_order_check(tmp_path):
    """Each send fired before the receive, in a call of its own, and waited for after it
    (isend, then recv), as the chapter's pipeline once did: on gloo it runs, but under
    NCCL's rule the two stages of 1F1B wait on each other's send, and
    tests/test_ch06_pipeline.py's checks fail."""
    copy = inject(UNPAIRED, tmp_path / "copy")
    p2p = record_p2p(copy / "06-model-parallel", tmp_path / "out")
    assert p2p[0]["1f1b p2 m3"] != [[["send", 1]], [["send", 1], ["recv", 1]], [["send", 1], ["recv", 1]],
                                    [["recv", 1]]]
    assert not completes([p2p[rank]["1f1b p2 m3"] for rank in range(2)])


def test_sent_tensors_kept_to_the_end_of_the_step_fail_the_memory_check(tmp_path):
    """Every sent tensor kept until the step ends, as the chapter's pipeline once did: what
    1F1B's stages keep then grows with m, and is no longer the planner's."""
    copy = inject(KEPT, tmp_path / "copy")
    script, *args = KEPT.proof
    run_warm(torchrun_cmd(2, copy / script, *args, "--save-dir", tmp_path, "--experiment-name", "m"), timeout=300)
    off = kept_off_plan(read_json(tmp_path / "m" / "measure.json"))
    assert any(line.startswith("1f1b m=4") for line in off), off


SAMPLER = Mutant("one-sampler-rank-for-every-replica", "06-model-parallel/train_llm.py",
                 "sampler = DistributedSampler(data.train, num_replicas=dp, rank=dp_rank,",
                 "sampler = DistributedSampler(data.train, num_replicas=dp, rank=0,", 4, (), "")


def test_the_same_samples_on_every_replica_fail_the_comparison_with_chapter_01(tmp_path, tmp_path_factory):
    """Every dp replica reads replica 0's share of the shuffle (the same sampler rank
    everywhere): chapter 06's run (dp 2 x pp 2, tests/ch06_runs.py) no longer trains on
    chapter 01's global batch, and its very first loss says so."""
    copy = inject(SAMPLER, tmp_path / "copy")
    off = unlike_chapter_01(chapter_06_scenario(copy / "06-model-parallel", tmp_path),
                            chapter_01_scenario(tmp_path_factory))
    assert any(line.startswith("step 1: loss") for line in off), off
