"""Torch-free pieces of the policy's HTTP interface: wire types, error bodies, serving.

Why separate: the Gym servers call the generation service and share its serving helper,
but a Gym pod never runs the model, so importing these must not import torch (which costs
seconds of start-up for every replica).
"""

from __future__ import annotations

from dataclasses import dataclass

from aiohttp import web

from rolloutrun_runtime.contract.wire import CompletionResult, ErrorBody, ErrorDetail


@dataclass(frozen=True)
class GenerationRequest:
    """One model call: continue ``prompt_token_ids`` by up to ``max_tokens`` tokens.

    ``temperature`` 0 means greedy. With a ``seed`` the sampled tokens depend only on the
    seed and the logits. ``weight_version`` pins the weights; ``None`` follows refits.
    ``rollout_id``/``call_index`` key the call's token capture.
    """

    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    temperature: float = 1.0
    seed: int | None = None
    weight_version: int | None = None
    rollout_id: str | None = None
    call_index: int | None = None


@dataclass(frozen=True)
class GenerationResult:
    """Generated tokens, their behaviour logprobs and the weight version of each token."""

    token_ids: list[int]
    logprobs: list[float]
    weight_versions: list[int]
    finish_reason: str  # "stop" (eos) or "length"

    def to_json(self) -> dict[str, object]:
        """The ``POST /v1/completions`` answer (a :class:`CompletionResult`)."""
        answer = CompletionResult(
            token_ids=self.token_ids,
            logprobs=self.logprobs,
            weight_versions=self.weight_versions,
            finish_reason=self.finish_reason,
        )
        return answer.model_dump(mode="json")


def json_error(status: int, message: str, kind: str = "invalid_request_error") -> web.Response:
    """An OpenAI-style error body: ``{"error": {"message", "type", "code"}}``."""
    body = ErrorBody(error=ErrorDetail(message=message, type=kind, code=status))
    return web.json_response(body.model_dump(mode="json"), status=status)


async def serve_app(
    app: web.Application,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    cancel_on_disconnect: bool = False,
) -> tuple[web.AppRunner, str]:
    """Start ``app`` on ``host:port`` (0 picks a free port); return its runner and base URL.

    ``cancel_on_disconnect`` cancels a request's handler when its client goes away (the Gym
    uses it so a vanished trainer's episodes stop at once instead of running on unobserved).
    """
    runner = web.AppRunner(app, access_log=None, handler_cancellation=cancel_on_disconnect)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    server = site._server
    sockets = getattr(server, "sockets", None) or []
    if not sockets:
        await runner.cleanup()
        raise OSError(f"server on {host}:{port} has no listening socket")
    bound_port = sockets[0].getsockname()[1]
    url_host = f"[{host}]" if ":" in host else host
    return runner, f"http://{url_host}:{bound_port}"
