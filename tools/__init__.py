"""The commands a reader runs beside the chapters, each `python -m tools.<name>`:

- `tour`: every chapter in order, then one comparison (`chapters` lists them, once);
- `report`: many runs side by side, as a table and plots;
- `plan`: a training plan on paper: per-rank memory, traffic and checkpoint time;
- `bench_model` (with `step_profile`): the model's speed, and where a step's time goes;
- `peak`: the peak FLOP/s MFU is measured against on this machine;
- `data_memory`: each rank's memory against the size of the corpus;
- `gpu_check`: everything measured on a GPU machine, in one command;
- `two_hosts`: two machines simulated on one Linux box, for a multi-node run.

Nothing in `common` imports them.
"""
