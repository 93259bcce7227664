"""Run as a script by tests/test_whereabouts.py: the interleaving that killed a rank by SIGSEGV on CPython 3.11.

A thread asks where another thread is (qgather.runtime.whereabouts.frames_of) while a collection starts
inside that very call, and the collection's Python code (here a gc callback; in a rank, finalizers of
the failed case's objects) hands the GIL to the observed thread, which leaves the frame being read and
parks in another. On 3.11 a collection runs inside any allocation, e.g. of the frame object that
`sys._current_frames()` makes for the observed thread's frame, which then points at a dead frame.

Prints one JSON line: where the collection interrupted frames_of (empty: it did not run inside it)
and the frames frames_of returned (function names, oldest first).
"""

from __future__ import annotations

import gc
import json
import sys
import threading

from qgather.runtime.whereabouts import frames_of

ready, go, moved, done = (threading.Event() for _ in range(4))
observer = threading.get_ident()
armed = [False]
interrupted: list[str] = []


def on_collection(phase: str, info: dict) -> None:
    if phase == "start" and armed[0] and threading.get_ident() == observer:
        armed[0] = False
        interrupted.append(sys._getframe(1).f_code.co_name)
        go.set()
        moved.wait(10)  # the GIL goes to the observed thread, which leaves parked_before


def parked_before() -> None:
    ready.set()
    go.wait(10)


def parked_after(a: int = 1, b: int = 2, c: int = 3, d: int = 4, e: int = 5, f: int = 6) -> None:
    frame_of_another_size = [a, b, c, d, e, f]  # noqa: F841 (a frame unlike parked_before's)
    moved.set()
    done.wait(10)


def observed() -> None:
    parked_before()
    parked_after()


def main() -> None:
    thread = threading.Thread(target=observed, daemon=True)
    thread.start()
    ready.wait(10)
    gc.callbacks.append(on_collection)
    gc.collect()
    gc.set_threshold(1)  # the next allocation of a tracked object collects
    armed[0] = True
    frames = frames_of(thread.ident)
    armed[0] = False
    gc.set_threshold(700, 10, 10)
    done.set()
    thread.join(10)
    print(json.dumps({"interrupted": interrupted, "frames": [f.rsplit(" ", 1)[1] for f in frames]}), flush=True)


if __name__ == "__main__":
    main()
