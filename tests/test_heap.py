"""``rayapp.actors.heap``: what a step freed goes back to the OS, off the event loop."""

import asyncio
import subprocess
import sys
import threading

import pytest

from rayapp.actors import heap

FRAGMENT = """
import threading
from rayapp.actors.heap import trim_heap
def rss(): return int(open("/proc/self/status").read().split("VmRSS:")[1].split()[0]) / 1024
keep = []
def step():  # what a step does to the heap: many mid-sized buffers from a thread, a few kept
    xs = [bytes(3000) + bytes([i % 256]) for i in range(60000)]
    keep.extend(xs[::50])
t = threading.Thread(target=step); t.start(); t.join()
before = rss(); assert trim_heap(); print(before - rss())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
def test_a_trim_gives_back_the_memory_a_fragmented_arena_kept():
    out = subprocess.run([sys.executable, "-c", FRAGMENT], capture_output=True, text=True, timeout=120, check=True)
    assert float(out.stdout) > 100, out  # MB: ~170 MB freed but kept by glibc before the trim


def test_trim_soon_runs_in_a_worker_thread_and_does_not_wait(monkeypatch):
    ran, release = [], threading.Event()

    def slow_trim(pad: int) -> int:
        release.wait(10)
        ran.append(threading.current_thread() is not threading.main_thread())
        return 1

    monkeypatch.setattr(heap, "_TRIM", slow_trim)

    async def main():
        heap.trim_soon()  # returns at once, though the trim is still running
        assert ran == []
        release.set()
        for _ in range(100):
            if ran:
                break
            await asyncio.sleep(0.01)

    asyncio.run(main())
    assert ran == [True]
