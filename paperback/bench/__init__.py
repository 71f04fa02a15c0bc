"""Speed benchmarks: paperback beside transformers, with the memory roofline."""
