"""Everything the chapters share that is not their lesson, one small module per part:

- `model`, `masks`, `data`: the Llama model, attention masks, corpus/tokenizer/datasets
  (and `prepare`: local rank 0 of each machine builds the caches first).
- `cli`: the shared flags, validated as they are parsed (one line, exit status 2).
- `training`: optimizer, learning-rate schedule, validation, a text sample.
- `tracker`: a training loop's timing, progress bar, metrics.jsonl, summary and table,
  built on `metrics` (timers, summaries) and `peak` (the FLOP/s MFU is measured against).
- `distributed`: process-group helpers (the restart-safe join, teardown, thread budget).
- `runfolder`: one job per run folder (a lock), archives instead of deletion.
- `resume`, `durable`, `stopping`: chapter 04's checkpoint plumbing (which checkpoint to
  load, checksums, fsync, pruning) and stopping cleanly (signals, a vanished launcher).
- `net_errors`, `two_hosts`: one-line network errors; two simulated hosts for tests.
- `proof`, `sharding`: chapter 05's comparisons and sharding measurements.
- `report`, `tour`, `bench_model`: comparing runs, every chapter in order, model speed.
"""
