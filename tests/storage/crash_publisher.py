"""Child process for the file:// crash tests: publishes entries until it is SIGKILLed.

Usage: ``crash_publisher.py ROOT loop`` publishes ``snaps/step_<n>`` for n = 0, 1, ... and
prints ``n`` after each commit; ``crash_publisher.py ROOT fifo FIFO`` publishes one entry
whose second file is read from the named pipe FIFO (the test holds it open to freeze the
publisher mid-file).
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

from rolloutrun_runtime.storage import open_storage, publish_entry

FILES = 3


def content(step: int, index: int) -> bytes:
    """Deterministic content of file ``index`` of entry ``step``; sizes vary up to ~1 MiB."""
    seed = hashlib.sha256(f"{step}/{index}".encode()).digest()
    return seed * (1 + (seed[0] * 4096 + seed[1] * 16) // 32)


def main() -> None:
    root, mode = sys.argv[1], sys.argv[2]
    storage = open_storage(root)
    if mode == "loop":
        step = 0
        while True:
            publish_entry(
                storage, f"snaps/step_{step}", {f"f{i}": content(step, i) for i in range(FILES)}
            )
            print(step, flush=True)
            step += 1
    elif mode == "fifo":
        publish_entry(
            storage,
            "snaps/step_0",
            {"a": content(0, 0), "b": Path(sys.argv[3]), "c": content(0, 2)},
        )
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main()
