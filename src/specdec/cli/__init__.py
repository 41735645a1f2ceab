"""The `specdec` command line: the entry point, the shared flags and run-config files, and the generate subcommand."""
