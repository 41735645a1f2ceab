"""Transparent huge pages for llama.cpp's buffers, so that decoding's weight reads miss the TLB less: glibc's malloc asked for them from process start (the `specdec` command re-executes itself with the tunable), else a best-effort MADV_COLLAPSE after each load.

A decoding step streams every weight once: about 1 GB for the default 1.5B target, 250,000 pages of
4 KiB. llama.cpp allocates its repacked/AMX weights, KV cache and compute buffers with plain malloc,
which on a kernel whose THP mode is `madvise` (Debian's default) gets 4 KiB pages. Measured on the 2-vCPU
AMX Xeon, one-row decode at depth 300, 2 threads: 76-77 ms a token before, 61.5 ms after collapsing the
new mappings (about 1.2 GB in 3 s, once per load). But MADV_COLLAPSE refuses some mappings (EINVAL):
loaded through `specdec.load()` (tokenizer and draft too) only 0.2 of 1.3 GiB was taken and the step
stayed at 69-73 ms. glibc (2.35+) asks for huge pages on its own mappings when the process starts with
GLIBC_TUNABLES=glibc.malloc.hugetlb=1: the same load then had 1.6 GiB on huge pages and 61-63 ms steps.
A tunable is read only at process start, so the `specdec` command sets it and re-executes itself once
(cli.entry); a library user sets it before starting Python. Nothing happens where THP is `never`, on
other systems, or with SPECDEC_HUGEPAGES=0.
"""

from __future__ import annotations

import ctypes
import os
import sys
import time

MADV_HUGEPAGE = 14
MADV_COLLAPSE = 25  # Linux 6.1+
HUGE_PAGE = 2 << 20
_THP_MODE = "/sys/kernel/mm/transparent_hugepage/enabled"


def enabled() -> bool:
    """Whether to collapse: Linux, THP not `never`, and not turned off with SPECDEC_HUGEPAGES=0."""
    if not sys.platform.startswith("linux") or os.environ.get("SPECDEC_HUGEPAGES", "1") == "0":
        return False
    try:
        with open(_THP_MODE, encoding="ascii") as handle:
            return "[never]" not in handle.read()
    except OSError:
        return False


TUNABLE = "glibc.malloc.hugetlb=1"
# What GLIBC_TUNABLES was before the re-execution, so that the programs we start (llama-server, the peers
# a bench compares us with) run in the environment the user gave, not in ours.
BEFORE = "SPECDEC_GLIBC_TUNABLES_BEFORE"


def malloc_uses_huge_pages(environ=os.environ) -> bool:
    """Whether this process started with glibc's malloc asking for transparent huge pages."""
    return TUNABLE in environ.get("GLIBC_TUNABLES", "").split(":")


def _glibc_has_the_tunable() -> bool:
    try:
        name, version = os.confstr("CS_GNU_LIBC_VERSION").split()
        major, minor = (int(part) for part in version.split(".")[:2])
    except (ValueError, OSError, AttributeError):
        return False
    return name == "glibc" and (major, minor) >= (2, 35)


def environment_for_huge_pages(environ=os.environ) -> dict[str, str] | None:
    """The environment to re-execute with so that malloc asks for huge pages; None where nothing would change."""
    if not enabled() or malloc_uses_huge_pages(environ) or not _glibc_has_the_tunable():
        return None
    given = environ.get("GLIBC_TUNABLES")
    tunables = [t for t in (given or "").split(":") if t]
    return {**environ, "GLIBC_TUNABLES": ":".join([*tunables, TUNABLE]), BEFORE: "" if given is None else given}


def environment_as_given(environ=os.environ) -> dict[str, str]:
    """This process's environment with GLIBC_TUNABLES as it was before the re-execution (for child programs)."""
    env = dict(environ)
    if BEFORE in env:
        given = env.pop(BEFORE)
        if given:
            env["GLIBC_TUNABLES"] = given
        else:
            env.pop("GLIBC_TUNABLES", None)
    return env


def anonymous_regions(maps: str = "/proc/self/maps") -> set[tuple[int, int]]:
    """(start, end) of this process's private writable anonymous mappings of at least one huge page."""
    regions = set()
    try:
        with open(maps, encoding="ascii", errors="replace") as handle:
            for line in handle:
                fields = line.split()
                named = len(fields) > 5 and fields[5] != "[heap]"
                if named or len(fields) < 5 or not fields[1].startswith("rw") or fields[1][3] != "p":
                    continue
                start, end = (int(value, 16) for value in fields[0].split("-"))
                if end - start >= HUGE_PAGE:
                    regions.add((start, end))
    except OSError:
        pass
    return regions


def collapse(regions: set[tuple[int, int]]) -> dict:
    """Ask the kernel to back each region with huge pages now; {"bytes": bytes of regions it took, "seconds": s}."""
    started = time.perf_counter()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.madvise.restype = ctypes.c_int
    taken = 0
    for start, end in sorted(regions):
        # MADV_HUGEPAGE first so that the region stays eligible (khugepaged, later growth) under `madvise`.
        libc.madvise(start, end - start, MADV_HUGEPAGE)
        if libc.madvise(start, end - start, MADV_COLLAPSE) == 0:
            taken += end - start
    return {"bytes": taken, "seconds": round(time.perf_counter() - started, 3)}


class NewRegions:
    """Snapshot of the anonymous regions before a load; collapse_new() backs what the load added with huge pages."""

    def __init__(self):
        self.active = enabled() and not malloc_uses_huge_pages()  # with the tunable, pages are huge already
        self.before = anonymous_regions() if self.active else set()

    def collapse_new(self) -> dict | None:
        if not self.active:
            return None
        return collapse(anonymous_regions() - self.before)
