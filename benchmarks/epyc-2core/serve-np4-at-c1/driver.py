"""Driver: the serving bench at C=1 with `ours` started as --parallel 4 (what a 4-slot default would run) and
ours_serial as --parallel 1, same run, same prompts."""
import sys
import specdec.bench.serving as s
orig = s.our_command
def patched(options, system, concurrency, port, parallel):
    cmd = orig(options, system, concurrency, port, parallel)
    if system == "ours":
        i = cmd.index("--parallel"); cmd[i + 1] = "4"
    return cmd
s.our_command = patched
from specdec.cli import main
sys.exit(main(sys.argv[1:]))
