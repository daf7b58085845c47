"""Everything the chapters share that is not their lesson: the Llama model (`model`),
attention masks (`masks`), corpus/tokenizer/datasets (`data`), timers and output files
(`metrics`), the shared command line (`cli`), the comparison report (`report`) and the
tour that runs every chapter (`tour`)."""
