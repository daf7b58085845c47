"""Run a script as Python 3.14 does on Linux: with forkserver as multiprocessing's default
start method (fork before it). `python tests/forkserver_default.py SCRIPT ARGS...`, or as
the script torchrun starts."""

import multiprocessing
import os
import runpy
import sys

if __name__ == "__main__":
    multiprocessing.set_start_method("forkserver", force=True)
    sys.argv = sys.argv[1:]
    sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))  # the script's folder, as `python script` has it
    runpy.run_path(sys.argv[0], run_name="__main__")
