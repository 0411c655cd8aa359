"""Running units: in this process or in spawned worker processes, committing each as it finishes.

``run_unit`` runs in the main process or in spawned worker processes (``run_units``), each with its own
model and one thread: on a 2-core machine two single-threaded encoders beat one two-threaded one.

This module imports nothing heavy at its top: a spawned worker imports it to run its initializer, whose
first act is to make sure the worker dies with its parent (``_die_with_parent``); torch and the model
are imported after that, so a worker whose parent is already gone exits in about a second, not after
the ~10-25 s of importing torch on a busy machine.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from encodec import EncodecModel

    from musiclm_stab.tokenizer.policy import UnitSettings
    from musiclm_stab.tokenizer.segments import Piece
    from musiclm_stab.tokenizer.sources import SourceSpec, TrackRef


_WORKER: dict[str, Any] = {}


def _die_with_parent(parent: int) -> None:
    """Ask Linux to kill this worker when its parent dies, and exit at once if it has died already, so
    that kill -9 of the tokenizer leaves no orphans, whenever it lands.

    PR_SET_PDEATHSIG covers only a parent that dies after the request, and this runs only after spawn's
    bootstrap (starting the interpreter, importing the main module and this one): a parent killed before
    that has already handed the worker to init (or a subreaper), whose death never comes, and the worker
    waited for work forever, its model loaded (~0.85 GB). Hence the check after the request: ``parent`` is
    the pid the tokenizer passed in, because once reparented, os.getppid() is already the new parent's.
    """
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:  # died before the request: nobody will send the signal
        os._exit(1)


def keep_freed_memory() -> bool:
    """Tell glibc's malloc to keep freed memory for reuse instead of returning it to the kernel.

    The encoder allocates and frees hundreds of MB of activations per batch. By default glibc serves
    allocations that large with fresh mmap()s and unmaps them when freed, so every batch faults in
    (and the kernel zeroes) all of that memory again: measured here, half of a worker's time was
    spent in the kernel. With an mmap threshold of 1 GiB the heap keeps the freed blocks and the next
    batch, of the same shapes, reuses them; trimming is off, so the heap's top is not handed back
    either (it came back at the next batch, faulting again: up to 20% more CPU in some runs).
    The price is the heap's fragmentation: a worker's RSS climbs over its first batches and then stays.
    When whole batches went through the convolutions it settled 1-1.5 GB above the first batch's; since
    ``encode_batch`` runs them one segment at a time, the blocks are one segment's size and the climb is
    ~0.1 GB (benchmarks/README.md, "Peak memory").
    Linux/glibc only; returns whether it applied. Called in the worker processes only: it changes the
    allocator of the whole process.
    """
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
        return bool(libc.mallopt(M_MMAP_THRESHOLD, 1 << 30)) and bool(libc.mallopt(M_TRIM_THRESHOLD, -1))
    except (OSError, AttributeError):
        return False


def _worker_init(parent: int, weights: str | None, device: str, sha256: str) -> None:
    _die_with_parent(parent)
    import torch

    from musiclm_stab.tokenizer.encode import set_full_fp32
    from musiclm_stab.tokenizer.weights import load_encodec, prepare_for_inference

    keep_freed_memory()
    torch.set_num_threads(1)  # as in the main process: see musiclm_stab.threads.one_thread
    set_full_fp32()  # as in the main process: see full_fp32
    model, info = load_encodec(weights)
    if info["weights_sha256"] != sha256:
        raise RuntimeError(f"worker {os.getpid()} loaded weights {info['weights_sha256']}, expected {sha256}")
    _WORKER["model"] = prepare_for_inference(model).to(torch.device(device))


def _worker_run(spec: SourceSpec, k: int, refs: list[TrackRef], settings: UnitSettings, out_dir: str,
                piece: Piece | None) -> dict:
    from musiclm_stab.tokenizer.units import run_unit

    return run_unit(spec, k, refs, _WORKER["model"], settings, out_dir, piece)


def run_units(work: Iterable[tuple], spec: SourceSpec, settings: UnitSettings, out_dir: str,
              on_done: Callable[[dict], None], model: EncodecModel | None, workers: int,
              weights: str | None = None, device: str = "cpu", sha256: str = "") -> None:
    """Run units in order in this process (``workers=0``, with ``model``), or in ``workers`` spawned
    processes, at most two units per worker in flight; ``on_done(record)`` runs here as each finishes.

    ``work`` yields (k, tracks) or (k, tracks, piece). When a unit raises (or the work list does),
    no new unit starts, the units in flight are finished and committed, then the first error is raised:
    a rerun redoes only what was not committed.
    """
    items = ((item[0], item[1], item[2] if len(item) > 2 else None) for item in work)
    if workers == 0:
        from musiclm_stab.tokenizer.units import run_unit

        for k, refs, piece in items:
            on_done(run_unit(spec, k, refs, model, settings, out_dir, piece))
        return
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")  # fork after torch has started threads can deadlock
    with ProcessPoolExecutor(workers, mp_context=ctx, initializer=_worker_init,
                             initargs=(os.getpid(), weights, device, sha256)) as pool:
        inflight: dict[Future, int] = {}
        error: BaseException | None = None
        try:
            while True:
                while error is None and len(inflight) < 2 * workers:
                    try:
                        nxt = next(items, None)
                    except Exception as e:  # the source failed: finish what runs, then report it
                        error = e
                        break
                    if nxt is None:
                        break
                    k, refs, piece = nxt
                    inflight[pool.submit(_worker_run, spec, k, refs, settings, out_dir, piece)] = k
                if not inflight:
                    break
                done, _ = wait(inflight, return_when=FIRST_COMPLETED)
                for f in sorted(done, key=inflight.__getitem__):
                    del inflight[f]
                    try:
                        record = f.result()
                    except Exception as e:  # commit the others first: they are finished work
                        error = error or e
                        continue
                    on_done(record)
        except BaseException:
            pool.shutdown(wait=True, cancel_futures=True)
            raise
    if error is not None:
        raise error
