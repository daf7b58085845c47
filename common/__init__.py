"""Everything the chapters share that is not their lesson, one small module per part, in
layers (no module imports one that imports it back):

- `model`, `masks`, `data`: the Llama model, attention masks, corpus/tokenizer/datasets
  (and `local_rank0_first`: local rank 0 of each machine builds the caches first).
- `cli`: the shared flags, validated as they are parsed; `errors`: the one-line
  failures (exit status 2) and `run_main`, around every chapter's main().
- `environment`: device facts, and the setup every chapter's `setup()` shows (CPU
  threads, TF32, stopping with torchrun).
- `training`: optimizer, learning-rate schedule, validation, a text sample.
- `tracker`: a training loop's bookkeeping, built on `timing` (phase timers, tokens/s),
  `jsonfiles` (metrics.jsonl, atomic JSON), `summary` (summary.json, the throughput
  table), `tables` (Markdown) and `peak_flops` (the FLOP/s MFU is measured against);
  `step_profile`: where a training step's time goes (`bench_model --profile`).
- `distributed`: process-group helpers (the backend for a device, the restart-safe join,
  teardown);
  `net_errors`: network setups that cannot work, said in one line.
- `runfolder`: one job per run folder (a lock), archives instead of deletion.
- `checkpoint_folder`, `durable`: the housekeeping around chapter 04's checkpoints
  (committing on rank 0, pruning, the settings that define a run; checksums, fsync,
  atomic writes). The lesson itself is in the chapter's folder.
- `proof`, `sharding`, `timeline`: chapter 05's comparisons, sharding measurements and
  profiler traces.

Command-line tools, which no library module imports: `report`, `tour`, `bench_model`,
`peak`, `plan`, `data_memory`, `gpu_check` (everything measured on a GPU; `python -m
common.X`), and `two_hosts` (two simulated hosts for tests).
"""
