"""Not a test: a deliberately wrong ZeRO-1 for tests/test_ch05_sharded.py, launched with
torchrun like the script itself. Rank 1 forgets to divide its gradients by the world
size before the reduce-scatter (so its contribution counts N times over). Everything
else is sharded_from_scratch.py unchanged; its proof must say FAILED and exit 1."""

import sys

from conftest import load_script

sharded = load_script("05-collectives/sharded_from_scratch.py")


def after_backward(self):
    if self.demo.rank != 1:
        self.flat.grad_full.div_(self.demo.world)
    self.comm.reduce_scatter(self.flat.grad_shard, self.flat.grad_full)


sharded.ZeRO1.after_backward = after_backward
sys.exit(sharded.main())
