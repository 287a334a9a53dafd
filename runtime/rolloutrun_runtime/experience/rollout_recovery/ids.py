"""Every id of a rollout, built and parsed here and nowhere else.

The names nest, so each one maps back to the one it came from:

    group id        chosen by the rollout pump (``<step>-<prompt>`` or a replacement's)
    sibling id      ``<group_id>_g<index>``          one per GRPO generation slot
    rollout id      ``<sibling_id>_a<uuidhex>``      one per attempt the ledger launches
    row key         ``<rollout_id>``                 at environment attempt 0
                    ``<rollout_id>-a<attempt>``      after a turn-level restore continued it

The row key is both the data plane's key for the attempt's result and the environment's
episode key, so the trainer and the Gym must agree on it; a rollout id may therefore never
end in ``-a<N>`` itself, or two episodes would share a key.
"""

from __future__ import annotations

import os
import random
import re
import uuid

_ATTEMPT_SUFFIX = re.compile(r"-a\d+$")
_ROW_KEY = re.compile(r"^(?P<rollout>.+?)(?:-a(?P<attempt>\d+))?$")
_SIBLING_SEPARATOR = "_g"
_UUID_SEPARATOR = "_a"


class RolloutIdError(ValueError):
    """A string that is not the id it is claimed to be (the message names which)."""


def sibling_id_for(group_id: str, index: int) -> str:
    """The id of generation slot ``index`` of prompt group ``group_id``."""
    return f"{group_id}{_SIBLING_SEPARATOR}{index}"


#: Attempt uuids come from a generator seeded once from the OS: random 128-bit ids like
#: ``uuid4`` without a system call per attempt (the rollout pump mints one per sibling).
_IDS = random.Random(os.urandom(32))
os.register_at_fork(after_in_child=lambda: _IDS.seed(os.urandom(32)))


def new_uuid_hex() -> str:
    """A random 128-bit id as 32 hex digits (``uuid4().hex`` format, version bits set)."""
    return uuid.UUID(int=_IDS.getrandbits(128), version=4).hex


def rollout_id_for(sibling_id: str, attempt_uuid: str) -> str:
    """The physical rollout id of one attempt of ``sibling_id``; refuses a clashing id."""
    rollout_id = f"{sibling_id}{_UUID_SEPARATOR}{attempt_uuid}"
    if not valid_rollout_id(rollout_id):
        raise RolloutIdError(f"rollout id {rollout_id!r} may not end in '-a<N>'")
    return rollout_id


def split_rollout_id(rollout_id: str) -> tuple[str, str]:
    """``(sibling_id, attempt_uuid)`` of a rollout id built by :func:`rollout_id_for`."""
    sibling_id, separator, attempt_uuid = rollout_id.rpartition(_UUID_SEPARATOR)
    if not separator or not sibling_id or not attempt_uuid:
        raise RolloutIdError(f"not a rollout id (<sibling>_a<uuid>): {rollout_id!r}")
    return sibling_id, attempt_uuid


def valid_rollout_id(rollout_id: str) -> bool:
    """Rollout ids may not end in ``-a<N>``, so row keys map back one to one."""
    return _ATTEMPT_SUFFIX.search(rollout_id) is None


def row_key_for(rollout_id: str, attempt: int) -> str:
    """The row (episode) key: the bare rollout id at attempt 0, ``<id>-a<attempt>`` after."""
    return rollout_id if attempt == 0 else f"{rollout_id}-a{attempt}"


def parse_row_key(row_key: str) -> tuple[str, int]:
    """``(rollout_id, attempt)`` of a row key built by :func:`row_key_for`."""
    match = _ROW_KEY.match(row_key)
    if match is None:
        raise RolloutIdError(f"not an episode row key: {row_key!r}")
    return match["rollout"], int(match["attempt"] or 0)
