"""``HostCopyStream``: the ``CopyStream`` of a backend whose "device" memory is host memory (cuda-emu, the test
backend numpy-device), so weight streaming runs the very same staged, event-ordered schedule as on a GPU.

Copies run on one worker thread in submission order (a CUDA stream's order); an event is the copy's future. The
compute queue is the calling thread, which runs kernels synchronously, so an event recorded there has already
completed, and making it wait for an event is blocking on the future. A missing wait or a staging buffer reused
too early is thus a real race here, as it would be on the device.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np


class HostCopyStream:
    def __init__(self, copy_in):
        self._copy_in = copy_in  # the backend's host -> "device" copy
        self._queue = ThreadPoolExecutor(max_workers=1, thread_name_prefix="copy-stream")

    def staging(self, nbytes: int) -> np.ndarray:
        return np.zeros(nbytes, np.uint8)

    def record(self) -> Future:
        done: Future = Future()
        done.set_result(None)  # the compute queue is synchronous: what was issued has finished
        return done

    def upload(self, dst, src: np.ndarray, after: Future | None = None) -> Future:
        def copy() -> None:
            if after is not None:
                after.result()
            self._copy_in(dst, src)

        return self._queue.submit(copy)

    def wait(self, event: Future) -> None:
        event.result()

    def host_wait(self, event: Future) -> None:
        event.result()

    def close(self) -> None:
        self._queue.shutdown(wait=True)
