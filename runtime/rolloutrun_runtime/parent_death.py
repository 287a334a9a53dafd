"""A helper process that dies with the process that started it.

Why one module: the trainer starts helper processes (the Lease keeper, the snapshot writer)
whose work must never outlive it: a keeper still renewing would hold a dead trainer's Lease,
a writer still writing could race the next incarnation. End of input alone does not ensure
it, since a process the trainer forked may hold the helper's input open. On Linux the
kernel's parent-death signal does; it is armed first thing in the helper, and a parent
that died before it was armed is caught by comparing the parent pid.
"""

from __future__ import annotations

import contextlib
import os
import signal

#: ``prctl``'s option number for the parent-death signal (``<linux/prctl.h>``).
PR_SET_PDEATHSIG = 1


def die_with_parent(parent: int) -> None:
    """SIGKILL this process when its parent dies (Linux; elsewhere nothing is armed), and
    exit at once if ``parent`` died before the signal was armed."""
    with contextlib.suppress(OSError, AttributeError):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:
        os._exit(0)
