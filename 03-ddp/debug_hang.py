"""Chapter 03: debugging a hang. Two bugs that stop a data-parallel job, on tiny tensors
(no model), and the tools that find them.

    TORCH_DISTRIBUTED_DEBUG=DETAIL torchrun --standalone --nproc-per-node=2 03-ddp/debug_hang.py
    TORCH_DISTRIBUTED_DEBUG=DETAIL torchrun --standalone --nproc-per-node=2 03-ddp/debug_hang.py --failure hang

--failure mismatch: only rank 0 all-reduces the loss for its log line, so from then on
the ranks' collectives no longer pair up. DETAIL checks every collective against every
rank's before running it and names the mismatch.
--failure hang: the last rank gets one batch fewer, leaves the loop and spends a long time
in validation, while the others wait in the last step's all-reduce until --timeout.

Every rank prints its Python stack (every thread) on stderr when it receives SIGUSR1,
without stopping: `kill -USR1 <pid>` while it hangs shows where each rank is.
"""

import faulthandler
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

from common.cli import one_of, positive_int
from common.demos import script_parser, start_group

GRAD_NUMEL = 1000  # the stand-in for one gradient bucket
LINGER_S = 3  # after a failure, time for the other ranks to print theirs


def parse_args(argv=None):
    # Checked before any process group exists: bad input costs nothing and leaves nothing.
    p = script_parser("03-ddp-debug-hang", "Two bugs that hang a data-parallel job, and "
                      "what TORCH_DISTRIBUTED_DEBUG=DETAIL, the timeout and the ranks' stacks "
                      "say about them. Launch with torchrun (2 or more processes).",
                      run_folder=False)
    p.add_argument("--failure", default="mismatch", type=one_of("mismatch", "hang"),
                   help="mismatch: rank 0 alone all-reduces the loss; hang: the last rank has "
                        "one batch fewer and sits in validation")
    p.add_argument("--steps", type=positive_int, default=3, help="training steps")
    p.set_defaults(timeout=20.0)  # short: the hang waits this long
    return p.parse_args(argv)


def train_step(grad, loss, rank, failure):
    dist.all_reduce(grad)  # DDP's gradient all-reduce: every rank, every step
    # The bug: the loss is averaged for the log line on rank 0 only. Rank 0's all-reduce
    # then meets the other ranks' next gradient all-reduce.
    if failure != "mismatch" or rank == 0:
        dist.all_reduce(loss)


def validate(seconds):
    """Slow work outside any collective (a long validation, a stuck data loader): here, a sleep."""
    time.sleep(seconds)


def main():
    args = parse_args()
    # kill -USR1 <pid>: this process prints every thread's Python stack on stderr and goes on
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    group = start_group(args.timeout)
    rank, world = group.rank, group.world
    pids = [None] * world
    dist.all_gather_object(pids, os.getpid())
    if rank == 0:
        print(f"failure: {args.failure}; {world} ranks; TORCH_DISTRIBUTED_DEBUG="
              f"{os.environ.get('TORCH_DISTRIBUTED_DEBUG', 'OFF')}; timeout {args.timeout:g} s\n"
              f"pids: {' '.join(f'rank {r}={pid}' for r, pid in enumerate(pids))}  "
              f"(while it hangs: kill -USR1 <pid>, or py-spy dump --pid <pid>)", flush=True)
    grad = torch.ones(GRAD_NUMEL, device=group.device)
    loss = torch.ones(1, device=group.device)
    short = args.failure == "hang" and rank == world - 1  # one batch fewer than the others
    step = 0
    try:
        for step in range(args.steps - 1 if short else args.steps):
            if rank == 0:
                print(f"step {step}", flush=True)
            train_step(grad, loss, rank, args.failure)
            if group.device.type == "cuda":
                torch.cuda.synchronize()  # nccl only queues the work: wait where a hang shows
        if short:
            # Bounded so that it ends under any launcher; torchrun stops it sooner.
            validate(args.timeout + 60)
        dist.barrier()
    except RuntimeError as e:  # gloo raises in the waiting ranks
        # One rank after another: DETAIL's reports are long, and two ranks writing to one
        # terminal at once would splice their lines together.
        time.sleep(0.5 * rank)
        print(f"rank {rank} failed in step {step}: {e}", flush=True)
        # Linger before exiting: torchrun stops the other ranks as soon as one exits with an
        # error, and a rank that has not printed its own report yet would be cut off.
        time.sleep(LINGER_S)
        return 1
    # After a failure the group is broken and tearing it down could block; torchrun ends
    # the other ranks anyway. Here nothing failed.
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
