"""The package version, in one place (read by the public API, the command line and the benchmarks' environment record)."""

__version__ = "0.1.0"
