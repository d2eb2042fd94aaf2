"""Bucket-wide tensor kernels the compressors share: segments, bit packing, draws, top-k selection, sparse payloads."""
