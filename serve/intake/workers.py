"""Image workers: the intake's pixel work in a pool of processes (``--image-workers N``).

Why: every image a request carries is decoded, checked and reduced by the intake
(:func:`serve.intake.images.prepare_image`), and vLLM 0.32 then preprocesses it on the one
multimodal thread of the API process (``vllm/renderers/base.py``: ``_mm_executor``, one
worker). In worker threads of the API process our decode shares that process's GIL and cores
with vLLM's thread and the event loop, so photo throughput is capped near one core. On a GPU
host the engine needs few cores and the rest are idle: N processes decode N photos at once.

What crosses: the client's encoded bytes go to a worker (pickled: one copy), and
:func:`~serve.intake.images.prepare_pixels`'s result comes back (the PNG ``data:`` URL of a
reduced or re-encoded image; sizes only for a passthrough, whose URL the API process builds
from the client's own base64 text). It is the very function of the serial path, so the
forwarded bytes are the same; a refused image comes back as the same
:class:`~serve.intake.errors.IntakeError` (it pickles with its fields).

Processes come from a ``forkserver``, not ``fork``: the API process runs threads (vLLM's, the
event loop's executor), and a child forked from a threaded process can inherit a lock held
by a thread that does not exist in it. The forkserver imports ``serve.intake.images``
(Pillow, NumPy, torch through the processor module) once; each worker is a fork of that
single-threaded server, so a worker starts in milliseconds and shares those pages.

A worker that dies (killed, out of memory, a decoder crash) breaks the pool for every job in
it (``BrokenProcessPool``): the pool is replaced and each of those images tried once more in
the new one; an image that breaks a pool twice is refused with a 400. Workers exit when the
pool shuts down with the app, and within :data:`ORPHAN_CHECK_S` of their forkserver's exit
(it exits when the API process dies, even by SIGKILL).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

from serve.intake.errors import IntakeError
from serve.intake.images import (
    ImagePolicy,
    PreparedImage,
    finish_passthrough,
    prepare_image,
    prepare_pixels,
)

log = logging.getLogger("serve.intake.workers")

#: Seconds between a worker's checks that its forkserver (hence the API process) still runs.
ORPHAN_CHECK_S = 1.0
#: Tries of one image when its pool breaks under it (the second in a fresh pool).
ATTEMPTS = 2


def _init_worker() -> None:
    """Worker start: leave Ctrl-C to the API process (which drains, then shuts the pool
    down), and exit once orphaned."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(ORPHAN_CHECK_S)
        os._exit(0)

    threading.Thread(target=watch, name="orphan-watch", daemon=True).start()


def _prepare_in_worker(raw: bytes, policy: ImagePolicy, num_crops: int,
                       param: str) -> tuple[int, PreparedImage]:
    """:func:`prepare_pixels` in a worker, with the worker's pid (``ImageWorkers.last_pid``)."""
    return os.getpid(), prepare_pixels(raw, policy, num_crops, param)


def _started(hold_s: float) -> int:
    """A start-up job: held ``hold_s`` so that each of :meth:`ImageWorkers.start`'s jobs
    finds no idle worker and a new one is started for it. Returns the worker's pid."""
    time.sleep(hold_s)
    return os.getpid()


class ImageWorkers:
    """A process pool for :func:`prepare_image`'s pixel work, one per API process.

    Args:
        workers: processes (>= 1). They start on :meth:`start` (or the first image) and stop
            on :meth:`close`.

    Thread-safe: the intake calls :meth:`prepare` from its worker threads, each blocking
    until its image is done.
    """

    def __init__(self, workers: int) -> None:
        if workers < 1:
            raise ValueError(f"image workers must be >= 1, got {workers}")
        self.workers = workers
        self._lock = threading.Lock()
        self._pool: ProcessPoolExecutor | None = None
        self._closed = False
        #: Images prepared in a worker, pools replaced after a worker died, the pid that
        #: prepared the last image (observability and tests).
        self.jobs = 0
        self.restarts = 0
        self.last_pid: int | None = None

    def _new_pool(self) -> ProcessPoolExecutor:
        context = multiprocessing.get_context("forkserver")
        # Imported once by the forkserver, inherited by every worker forked from it.
        context.set_forkserver_preload(["serve.intake.images"])
        return ProcessPoolExecutor(self.workers, mp_context=context,
                                   initializer=_init_worker)

    def _current(self) -> ProcessPoolExecutor | None:
        """The live pool (created on first use); None once closed."""
        with self._lock:
            if self._closed:
                return None
            if self._pool is None:
                self._pool = self._new_pool()
            return self._pool

    def _replace(self, broken: ProcessPoolExecutor) -> None:
        """Swap a broken pool for a new one (once, however many jobs saw it break)."""
        with self._lock:
            if self._pool is not broken or self._closed:
                return
            self._pool = self._new_pool()
            self.restarts += 1
        broken.shutdown(wait=False, cancel_futures=True)
        log.warning("an image worker died; image workers restarted (%d so far)",
                    self.restarts)

    def start(self) -> list[int]:
        """Start every worker now, blocking (the first call starts the forkserver, which
        imports Pillow and torch: seconds). Returns the workers' pids ([] once closed).

        Workers would otherwise start one per image until there are :attr:`workers`, the
        first paying the forkserver's start inside a request."""
        pool = self._current()
        if pool is None:
            return []
        try:
            futures = [pool.submit(_started, 0.1) for _ in range(self.workers)]
            return sorted({f.result() for f in futures})
        except RuntimeError:  # closed while starting (shutdown during boot)
            return []

    def prepare(self, raw: bytes, policy: ImagePolicy, num_crops: int, param: str,
                base64_payload: str | None = None) -> PreparedImage:
        """:func:`prepare_image` in a worker process, same arguments and result; blocks the
        calling thread until done. After :meth:`close` it runs in the calling thread.

        Raises:
            IntakeError: the image's own refusal (as :func:`prepare_image`), or 400 when the
                image killed a worker twice.
        """
        for _ in range(ATTEMPTS):
            pool = self._current()
            if pool is None:
                return prepare_image(raw, policy, num_crops, param, base64_payload)
            try:
                pid, image = pool.submit(_prepare_in_worker, raw, policy, num_crops,
                                         param).result()
            except BrokenProcessPool:
                self._replace(pool)
                continue
            except RuntimeError:
                if not self._closed:
                    raise
                # Closed between the two lines above (shutdown): as after close.
                return prepare_image(raw, policy, num_crops, param, base64_payload)
            with self._lock:
                self.jobs += 1
                self.last_pid = pid
            return finish_passthrough(image, raw, base64_payload)
        raise IntakeError(400, "image could not be decoded: its decoder process exited on it",
                          param)

    def close(self) -> None:
        """Stop the workers (waiting for images in progress); later images run in the calling
        thread."""
        with self._lock:
            pool, self._pool, self._closed = self._pool, None, True
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
