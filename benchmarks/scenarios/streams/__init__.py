"""benchmarks/streams.py: one subscription's delivery by a burst worker."""
