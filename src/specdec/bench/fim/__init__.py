"""`specdec bench --fim`: code completion (fill-in-the-middle) through /infill, ours beside llama-server, scored by unit tests."""
