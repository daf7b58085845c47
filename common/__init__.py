"""Everything the chapters share that is not their lesson: the Llama model (`model`),
attention masks (`masks`), corpus/tokenizer/datasets (`data`), timers and output files
(`metrics`), the peak FLOP/s that MFU is measured against (`peak`), the shared command
line (`cli`), the comparison report (`report`), the tour that runs every chapter
(`tour`) and the model's throughput benchmark (`bench_model`)."""
