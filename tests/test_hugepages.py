"""Huge pages for what a model load allocates: which mappings count, the off switch, and a real collapse (the region on 4 KiB pages before it, as the control)."""

from __future__ import annotations

import mmap

import pytest

from specdec.host import hugepages
from specdec.host.hugepages import (
    BEFORE,
    HUGE_PAGE,
    TUNABLE,
    NewRegions,
    anonymous_regions,
    collapse,
    environment_as_given,
    environment_for_huge_pages,
    malloc_uses_huge_pages,
)

MAPS = """\
00400000-00600000 r-xp 00000000 08:01 123 /usr/bin/python3
01000000-03000000 rw-p 00000000 00:00 0 [heap]
7f0000000000-7f0000400000 rw-p 00000000 00:00 0
7f0000400000-7f0000401000 rw-p 00000000 00:00 0
7f0001000000-7f0001400000 rw-s 00000000 00:01 77 /dev/shm/x
7f0002000000-7f0002400000 rw-p 00000000 08:01 99 /models/m.gguf
7f0003000000-7f0003400000 r--p 00000000 00:00 0
7ffd00000000-7ffd00400000 rw-p 00000000 00:00 0 [stack]
"""


def test_only_private_writable_anonymous_mappings_of_a_huge_page_or_more_count(tmp_path):
    maps = tmp_path / "maps"
    maps.write_text(MAPS)
    assert anonymous_regions(str(maps)) == {(0x01000000, 0x03000000), (0x7F0000000000, 0x7F0000400000)}
    assert anonymous_regions(str(tmp_path / "missing")) == set()


def test_the_switch_and_the_thp_mode_turn_it_off(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECDEC_HUGEPAGES", "0")
    assert NewRegions().collapse_new() is None
    monkeypatch.delenv("SPECDEC_HUGEPAGES")
    mode = tmp_path / "enabled"
    mode.write_text("always madvise [never]\n")
    monkeypatch.setattr(hugepages, "_THP_MODE", str(mode))
    assert not hugepages.enabled() and NewRegions().collapse_new() is None


def test_the_command_re_executes_with_the_glibc_tunable_once(monkeypatch):
    monkeypatch.setattr(hugepages, "enabled", lambda: True)
    monkeypatch.setattr(hugepages, "_glibc_has_the_tunable", lambda: True)
    env = environment_for_huge_pages({"PATH": "/bin"})
    assert env == {"PATH": "/bin", "GLIBC_TUNABLES": TUNABLE, BEFORE: ""} and malloc_uses_huge_pages(env)
    assert environment_for_huge_pages(env) is None  # once: the re-executed process has it
    assert environment_as_given(env) == {"PATH": "/bin"}  # what llama-server and other children get
    mine = environment_for_huge_pages({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"})
    assert mine["GLIBC_TUNABLES"] == f"glibc.malloc.arena_max=2:{TUNABLE}"  # the user's tunables kept
    assert environment_as_given(mine) == {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}
    assert environment_as_given({"A": "1"}) == {"A": "1"}  # never re-executed: unchanged
    monkeypatch.setattr(hugepages, "_glibc_has_the_tunable", lambda: False)  # musl, or glibc before 2.35
    assert environment_for_huge_pages({}) is None
    monkeypatch.setattr(hugepages, "_glibc_has_the_tunable", lambda: True)
    monkeypatch.setattr(hugepages, "enabled", lambda: False)  # THP never, or SPECDEC_HUGEPAGES=0
    assert environment_for_huge_pages({}) is None
    # With the tunable, a load collapses nothing itself.
    monkeypatch.setenv("GLIBC_TUNABLES", TUNABLE)
    monkeypatch.setattr(hugepages, "enabled", lambda: True)
    assert NewRegions().collapse_new() is None


def _huge_kib(start: int, end: int) -> int:
    """AnonHugePages of the mapping that starts at `start` (kB, from /proc/self/smaps)."""
    inside, total = False, 0
    with open("/proc/self/smaps") as handle:
        for line in handle:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= start < hi
            elif inside and line.startswith("AnonHugePages:"):
                total += int(line.split()[1])
    return total


@pytest.mark.skipif(not hugepages.enabled(), reason="no transparent huge pages here (not Linux, or THP never)")
def test_a_new_region_is_collapsed_onto_huge_pages():
    with open(hugepages._THP_MODE) as handle:
        always = "[always]" in handle.read()
    snapshot = NewRegions()
    region = mmap.mmap(-1, 16 * HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region.write(b"\1" * len(region))
    import ctypes

    start = ctypes.addressof(ctypes.c_char.from_buffer(region))
    if not always:  # Negative control: under `madvise` the fresh mapping sits on 4 KiB pages until collapsed
        assert _huge_kib(start, start + len(region)) == 0
    mine = {r for r in anonymous_regions() - snapshot.before if r[0] <= start < r[1]}
    assert mine
    result = collapse(mine)
    if result["bytes"] == 0:
        pytest.skip("the kernel refused MADV_COLLAPSE here (no free huge pages, or before Linux 6.1)")
    assert _huge_kib(start, start + len(region)) >= 8 * 1024  # most of the 32 MiB (its aligned 2 MiB parts)
