"""Training CLI: corpora, tokenizers, batches, backends, schedule, evaluation and benchmarks."""
