"""The llama.cpp backend: GGUF weights on llama-cpp-python's low-level API, its proofs and its apart-prefill context."""
