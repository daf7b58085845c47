"""The library the chapter scripts import: what they share and a reader may skip.

- `model`, `masks`, `data`: the Llama model, attention masks, corpus, tokenizer and the
  memory-mapped token files.
- `cli`, `errors`: the shared flags, checked as they are parsed; one-line failures and
  `run_main` around every chapter's main().
- `environment`, `distributed`: device facts and the setup each chapter shows;
  process-group helpers.
- `metrics` (over `timing`, `peak_flops`, `tables`): what a run records and prints.
- `training`, `runfolder`, `files`: optimizer and schedule; the run folder and the final
  weights; files written whole, and checksums.
- `demos`: what only the demonstration scripts share.

The commands (tour, report, plan, ...) are in `tools/`; no module here imports them.
"""
