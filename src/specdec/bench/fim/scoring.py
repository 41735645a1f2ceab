"""Scores a completion: the problem's unit test run on prefix + completion + suffix in a child Python with a timeout
and resource limits (pass@1), and exact match with the removed code."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

from specdec.bench.fim.problems import FimProblem

TEST_TIMEOUT = 10.0  # seconds; HumanEval's tests take well under one
MEMORY_BYTES = 1 << 30
FILE_BYTES = 16 << 20


def program(problem: FimProblem, completion: str) -> str:
    """The file the test runs: the completed code, the problem's `check`, and the call of it."""
    return f"{problem.prefix}{completion}{problem.suffix}\n\n{problem.test}\n\ncheck({problem.entry_point})\n"


def _limits() -> None:  # in the child, before exec: no more memory, CPU time, file size or processes
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_BYTES, MEMORY_BYTES))
    cpu = int(TEST_TIMEOUT) + 1
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
    resource.setrlimit(resource.RLIMIT_FSIZE, (FILE_BYTES, FILE_BYTES))
    resource.setrlimit(resource.RLIMIT_NPROC, (64, 64))


def passes(problem: FimProblem, completion: str, timeout: float = TEST_TIMEOUT) -> bool:
    """Whether the completed program passes its unit test: a child interpreter in isolated mode (-I: no user
    site, no PYTHON* variables), in an empty temporary directory, with an empty environment, no stdin, limits
    on memory, CPU, file size and processes, killed after `timeout` seconds. Generated code runs here: use
    this on a machine that holds nothing you would miss."""
    with tempfile.TemporaryDirectory(prefix="specdec-fim-") as folder:
        path = Path(folder) / "candidate.py"
        path.write_text(program(problem, completion), encoding="utf-8")
        try:
            done = subprocess.run([sys.executable, "-I", str(path)], cwd=folder, env={"PATH": os.defpath},
                                  stdin=subprocess.DEVNULL, capture_output=True, timeout=timeout,
                                  preexec_fn=_limits, check=False)
        except subprocess.TimeoutExpired:
            return False
        return done.returncode == 0


def exact_match(problem: FimProblem, completion: str) -> bool:
    """The completion is the removed code, trailing whitespace aside."""
    return completion.rstrip() == problem.solution.rstrip()
