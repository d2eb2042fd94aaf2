"""Exchange patterns several compressors share: two-phase, sparse shards and Zen's hashed sparse sum."""
