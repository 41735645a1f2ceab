"""Model references resolved and loaded as backends: hub ids, local folders, GGUF files, the packaged default pair."""
