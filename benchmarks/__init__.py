"""Benchmarks of multihead against PyTorch's attention and a tutorial implementation (``make bench``)."""
