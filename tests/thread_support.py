"""Running one function in several threads at once, for the thread-safety tests."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


def run_threads(target: Callable[[int], Any], count: int) -> list[Any]:
    """Run ``target(index)`` in ``count`` threads started together (a barrier), and return the
    results by index; the first error any thread raised is raised again here."""
    barrier = threading.Barrier(count)
    results: list[Any] = [None] * count
    errors: list[BaseException] = []

    def run(index: int) -> None:
        try:
            barrier.wait()
            results[index] = target(index)
        except BaseException as error:  # reported by the calling thread
            errors.append(error)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return results
