"""The decode loop: continuous batching over one target (scheduler), its one-request wrapper, the output records and detokenization."""
