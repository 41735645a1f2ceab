"""The GPU bench: pass-cost curves and decoding methods on CUDA, with dummy weights of real shapes."""
