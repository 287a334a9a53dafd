"""Per rollout, the exact tokens, logprobs and weight versions of each finished model call.

Why the engine keeps them: the model calls of a Gym episode go to the generation server, so
what they produced token by token (and under which weights) is known only there; a client
reads a rollout's calls back by its id (``GET`` on the token-capture route) and releases them
(``DELETE``). Bounded, so clients that never release cost at most
:data:`MAX_CAPTURED_ROLLOUTS` rollouts. Apart from :mod:`.engine` because it is bookkeeping
beside the decode loop, not part of it.
"""

from __future__ import annotations

import logging
from collections import OrderedDict

from rolloutrun_runtime.policy.http import GenerationRequest, GenerationResult

logger = logging.getLogger(__name__)

#: Most rollouts whose token capture is held before the oldest is released (callers release
#: a rollout's capture with DELETE once read; this bounds memory when they do not).
MAX_CAPTURED_ROLLOUTS = 16_384


class TokenCapture:
    """Per rollout, the exact tokens, logprobs and versions of each finished model call."""

    def __init__(self, max_rollouts: int = MAX_CAPTURED_ROLLOUTS) -> None:
        self.max_rollouts = max_rollouts
        self._rollouts: OrderedDict[str, dict[int, dict[str, object]]] = OrderedDict()

    def record(self, request: GenerationRequest, result: GenerationResult) -> None:
        if request.rollout_id is None:
            return
        calls = self._rollouts.setdefault(request.rollout_id, {})
        self._rollouts.move_to_end(request.rollout_id)
        index = request.call_index if request.call_index is not None else len(calls)
        calls[index] = {
            "call_index": index,
            "prompt_token_ids": list(request.prompt_token_ids),
            "token_ids": list(result.token_ids),
            "logprobs": list(result.logprobs),
            "weight_versions": list(result.weight_versions),
        }
        while len(self._rollouts) > self.max_rollouts:
            dropped, _ = self._rollouts.popitem(last=False)
            logger.warning("token capture full: released the oldest rollout %s", dropped)

    def get(self, rollout_id: str) -> list[dict[str, object]] | None:
        calls = self._rollouts.get(rollout_id)
        if calls is None:
            return None
        return [calls[index] for index in sorted(calls)]

    def release(self, rollout_id: str) -> bool:
        return self._rollouts.pop(rollout_id, None) is not None

    def __len__(self) -> int:
        return len(self._rollouts)
