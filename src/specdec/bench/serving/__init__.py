"""The serving bench: our server and llama-server under concurrent streaming requests, per concurrency level."""
