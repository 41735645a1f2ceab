"""The method bench: every decoding method run on the same prompts, interleaved; raw runs, aggregation, tables."""
