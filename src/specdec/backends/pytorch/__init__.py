"""The PyTorch backend: transformers models eager or on a static KV cache with CUDA graphs, and CPU weight formats."""
