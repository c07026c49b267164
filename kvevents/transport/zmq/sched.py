"""CPU scheduling of the publisher's own threads, so that they never preempt the engine's.

``publish()`` wakes the live thread; under CPU contention Linux's wake-up preemption then often
ran the woken thread (or a zmq I/O thread woken by a replay client) on the engine thread's CPU
at once, in the middle of ``publish()``: ``getrusage(RUSAGE_THREAD)`` counted an involuntary
context switch of the engine thread in ~25% of paced ``publish()`` calls, and in nearly all of
the slowest 2% (hundreds of microseconds each) on the 2-core machine under load.

``SCHED_BATCH`` keeps a thread's fair CPU share (its nice value and weight are unchanged, so a
thread holding the GIL is not starved) but a waking batch thread never preempts the running
one: it takes a free CPU, or waits for the running thread's tick or its sleep. Best effort:
where the policy is missing or refused, the threads run as before.
"""

from __future__ import annotations

import os

__all__ = ["batch_thread", "lower_io_threads", "threads"]

_BATCH = getattr(os, "SCHED_BATCH", None)


def batch_thread(tid: int = 0) -> bool:
    """Put the calling thread (or the thread ``tid``) under ``SCHED_BATCH``; whether it is."""
    if _BATCH is None:
        return False
    try:
        if os.sched_getscheduler(tid) != _BATCH:
            os.sched_setscheduler(tid, _BATCH, os.sched_param(0))
        return True
    except (OSError, AttributeError):
        return False


def threads() -> set[int]:
    """This process's thread ids (empty where /proc is missing)."""
    try:
        return {int(t) for t in os.listdir("/proc/self/task")}
    except OSError:
        return set()


def lower_io_threads(tids: set[int], prefix: str, nice: int) -> tuple[set[int], set[int]]:
    """``SCHED_BATCH`` and nice ``nice`` for those of ``tids`` (threads a ZeroMQ context just
    started) whose name starts with ``prefix`` (libzmq names its I/O threads
    ``<ZMQ_THREAD_NAME_PREFIX>/ZMQbg/IO/<n>``). A thread names itself once it runs, so one still
    under its creator's name stays pending: -> (lowered, pending). Threads named otherwise (the
    context's reaper, or a thread someone else started meanwhile) are left alone. The I/O
    threads never take the GIL, so a low priority cannot stall the engine."""
    lowered, pending = set(), set()
    try:
        with open("/proc/self/comm") as f:
            unnamed = f.read()
    except OSError:
        return lowered, pending
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read()
            if name == unnamed:
                pending.add(tid)
                continue
            if not name.startswith(prefix):
                continue
            if os.getpriority(os.PRIO_PROCESS, tid) < nice:
                os.setpriority(os.PRIO_PROCESS, tid, nice)
            batch_thread(tid)
            lowered.add(tid)
        except (OSError, ValueError):  # gone meanwhile, or not allowed
            continue
    return lowered, pending
