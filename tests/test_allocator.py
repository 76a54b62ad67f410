"""vitkit.cpu.allocator: after retain_freed_memory(), a large tensor allocated again and again is served from
glibc's heap instead of being faulted in from the kernel each time; after return_large_blocks(), it is given
back to the kernel each time (counted with getrusage, in a fresh process so that the setting starts from
glibc's defaults)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from vitkit.cpu import allocator

pytestmark = pytest.mark.skipif(allocator.glibc_version() is None, reason="the C library is not glibc")

PROBE = r"""
import json, resource, torch
from vitkit.cpu.allocator import retain_freed_memory

def faults(megabytes, rounds=8):
    start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(rounds):
        x = torch.empty(megabytes * 262144)
        x.fill_(1.0)
        del x
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - start

before = faults(24)
took = retain_freed_memory()
faults(24)  # the first block after the change still comes from the kernel once
after = faults(24)
print(json.dumps({"before": before, "after": after, "took": took}))
"""


def test_large_blocks_are_reused_after_retain_freed_memory():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True,
                         timeout=120)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["took"] is True
    pages = 24 * 2**20 // 4096
    # glibc's default: every 24 MB block is mmapped afresh and faulted in (with 4 KiB pages: 6,144 faults
    # each; fewer where the kernel hands out huge pages, but still some for every block).
    assert r["before"] >= 8
    # After: the 8 blocks come from the heap; at most one of them is faulted in again (seen twice in a row on
    # a 2-core machine while another test run started next to it: 6,144 faults against 43,033 before).
    assert r["after"] <= max(pages, r["before"] // 8) and r["after"] <= r["before"] // 4


def test_not_glibc_is_a_no_op(monkeypatch):
    monkeypatch.setattr(allocator, "_glibc", lambda: None)
    assert allocator.retain_freed_memory() is False
    assert allocator.return_large_blocks() is False
    assert allocator.glibc_version() is None


def test_glibc_version_reads_like_one():
    major, minor = allocator.glibc_version().split(".")[:2]
    assert int(major) >= 2 and int(minor) >= 0


RETURN_PROBE = r"""
import json, sys, torch
from pathlib import Path
from vitkit.cpu.allocator import return_large_blocks

def rss():
    return int(Path("/proc/self/statm").read_text().split()[1]) * 4096

took = return_large_blocks() if sys.argv[1] == "return" else None
kept = []
if sys.argv[2] == "buffers":  # FSDP's gathered weights: 24 MB blocks, one at a time
    start = rss()
    for _ in range(4):
        block = torch.empty(24 * 262144)
        block.fill_(1.0)
        kept.append(torch.ones(1000))  # a small tensor that outlives the block, allocated after it
        del block
else:  # a small batch's activations: 3 MB blocks alive together, each followed by a longer-lived tensor
    torch.empty(4 * 262144).fill_(1.0)  # freed at once: glibc's threshold rises to 4 MB
    start = rss()
    blocks = []
    for _ in range(8):
        blocks.append(torch.empty(3 * 262144).fill_(1.0))
        kept.append(torch.ones(65536))  # 256 KB: from the heap's top, after the block, in either mode
    del blocks
print(json.dumps({"held_mb": (rss() - start) / 2**20, "took": took}))
"""


def _held_after_freeing(mode: str, pattern: str = "buffers") -> dict:
    out = subprocess.run([sys.executable, "-c", RETURN_PROBE, mode, pattern], capture_output=True, text=True,
                         check=True, timeout=120)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_large_blocks_are_given_back_after_return_large_blocks():
    """FSDP's pattern: 24 MB blocks freed while small tensors allocated after them live on. glibc's default
    keeps the freed blocks' memory in its heap (its threshold rises past 24 MB after the first); after
    return_large_blocks() each block is mapped alone and given back when freed."""
    default, returned = _held_after_freeing("default"), _held_after_freeing("return")
    assert returned["took"] is True
    assert default["held_mb"] > 20  # a freed 24 MB block still resident
    assert returned["held_mb"] < 12  # none: what is left is the interpreter's own (8 MB seen in CI)


def test_activation_sized_blocks_are_given_back_too():
    """A batch of 2 at 224 px makes ViT-B/16 activations of 1-5 MB, freed while tensors made after them live
    on. glibc's default keeps them in its heap once its threshold has risen; after return_large_blocks()
    they are mapped alone (the threshold, 1 MiB, is below them) and given back."""
    default = _held_after_freeing("default", "activations")
    returned = _held_after_freeing("return", "activations")
    assert default["held_mb"] > 18  # the eight freed 3 MB blocks (24 MB) still resident
    assert returned["held_mb"] < 8
