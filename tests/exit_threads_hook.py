"""Run a trainer, then say which of gloo's threads are still alive:
the leak ``distributed.shutdown`` warns of.

    torchrun --standalone --nproc_per_node=2 tests/exit_threads_hook.py step7_zero3/train.py ...

Gloo's threads (``gloo_tcp_loop``, ``pt_gloo_runloop``) stop only when the process group is freed,
and ``destroy_process_group`` frees it only if nothing else holds it. A group still held at
interpreter exit lets a thread ask for the GIL while exit is under way: "terminate called without an
active exception", SIGABRT, now and then (see ``shutdown``'s docstring). A race is a poor test; a
thread that is alive after ``main`` is a sure one. train.py runs as ``__main__`` (its folder first
on sys.path, as when it runs by itself); then the garbage is collected, gloo's socket loop is given
5 s to end, and this prints one line from /proc:
``threads after main: NAME,NAME,...``.
"""

import gc
import os
import runpy
import sys
import time
from pathlib import Path


def thread_names() -> list[str]:
    """The names of this process's threads, main included (Linux's /proc;
    gloo names its threads)."""
    return sorted(
        Path(task, "comm").read_text().strip() for task in Path("/proc/self/task").iterdir()
    )


def main() -> None:
    script, *args = sys.argv[1:]
    sys.argv = [script, *args]
    sys.path.insert(0, str(Path(script).resolve().parent))
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as ended:
        if ended.code:
            raise
    gc.collect()
    # gloo's socket loop may end a moment after its group (test_data_parallel.py)
    deadline = time.monotonic() + 5
    while any("gloo" in name for name in thread_names()) and time.monotonic() < deadline:
        time.sleep(0.01)
    print(f"threads after main: {','.join(thread_names())}", flush=True)
    os._exit(0)  # what is left must not get the chance to abort the exit we are reporting on


if __name__ == "__main__":
    main()
