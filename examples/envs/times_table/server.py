"""times_table: a user's environment server, written against docs/environment-contract.md only.

The task: the prompt set (``prompts.jsonl``, or the same rows in Parquet) holds questions
such as ``7*4=`` with the product as the answer. The model answers; a wrong answer gets a
hint (`` lo>``: too low, `` hi>``: too high, `` ?>``: no number) and another turn, up to
``--max-turns``. The reward is in [0, 1]: 1 for the right product at the first turn, 0.7
at a later one, else partial credit for answering with a number and for being close.

What it imports from rolloutrun, and why: the wire models and route names of
``rolloutrun_runtime.contract.wire`` (the same pydantic models the trainer builds its
requests with, so a field this server reads is the field the trainer sends; a server in
another language reads the JSON the contract shows), the environment variable names of
``rolloutrun_runtime.contract.pod``, and the built-in policy's tokenizer (an environment
speaks in the policy's token ids; a Hugging Face policy's would be its ``tokenizer.json``).
Nothing of the built-in Gym (``rolloutrun_runtime.environments``) is used.

It serves no checkpoint control plane: its ``/healthz`` names no capability, so a run
asking for turn-level recovery recovers at sibling level and says so.

Run: ``python examples/envs/times_table/server.py --port 8000`` with the run's token in
``ROLLOUTRUN_GYM_CONTROL_TOKEN``; it prints ``READY <url>`` once it listens.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import hmac
import json
import os
import re
import signal
import socket
import sys
from typing import Any

import aiohttp
from aiohttp import web
from pydantic import ValidationError

from rolloutrun_runtime.contract.pod import ENV_GYM_INSTANCE_ID, ENV_GYM_TOKEN, ENV_POD_IP
from rolloutrun_runtime.contract.wire import (
    COMPLETIONS_ROUTE,
    GYM_POLICY_ROUTE,
    GYM_RUN_ROUTE,
    HEALTHZ_ROUTE,
    CompletionRequest,
    CompletionResult,
    GymHealth,
    PolicyAnnounced,
    PolicyAnnouncement,
    RunRequest,
    RunResult,
)
from rolloutrun_runtime.policy.tokenizer import TOKENIZER

TASK = "times_table"
_NUMBER = re.compile(r"-?\d{1,6}")


def turn_seed(seed: int, turn: int) -> int:
    """The contract's per-turn sampling seed (deterministic runs replay it)."""
    digest = hashlib.sha256(f"{seed}:turn:{turn}".encode()).digest()
    return int.from_bytes(digest[:8], "big") & (2**63 - 1)


def reward(answers: list[int | None], product: int) -> float:
    """1 at the first turn, 0.7 later; else credit for a number and for closeness."""
    for turn, value in enumerate(answers):
        if value == product:
            return 1.0 if turn == 0 else 0.7
    last = answers[-1] if answers else None
    if last is None:
        return 0.0
    return round(0.1 + 0.4 * max(0.0, 1.0 - abs(last - product) / max(product, 1)), 6)


def hint(value: int | None, product: int) -> str:
    if value is None:
        return " ?>"
    return " lo>" if value < product else " hi>"


def error(status: int, message: str, kind: str = "invalid_request_error") -> web.Response:
    body = {"error": {"message": message, "type": kind, "code": status}}
    return web.json_response(body, status=status)


class TimesTable:
    """One replica: the routes of the contract, episodes keyed by (rollout id, attempt)."""

    def __init__(self, instance_id: str, token: str, max_turns: int, max_seq_len: int) -> None:
        self.instance_id, self.token = instance_id, token
        self.max_turns, self.max_seq_len = max_turns, max_seq_len
        self.announced: set[str] = set()
        self.finished: dict[tuple[str, int], dict[str, Any]] = {}
        self.live: set[tuple[str, int]] = set()
        self.session: aiohttp.ClientSession | None = None

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self.auth])
        app.router.add_get(HEALTHZ_ROUTE, self.healthz)
        app.router.add_post(GYM_POLICY_ROUTE, self.policy)
        app.router.add_post(GYM_RUN_ROUTE, self.run)
        app.on_startup.append(self.start)
        app.on_cleanup.append(self.stop)
        return app

    async def start(self, _: web.Application) -> None:
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))

    async def stop(self, _: web.Application) -> None:
        if self.session is not None:
            await self.session.close()

    @web.middleware
    async def auth(self, request: web.Request, handler: Any) -> web.StreamResponse:
        if request.path != HEALTHZ_ROUTE:
            given = request.headers.get("Authorization", "").removeprefix("Bearer ")
            if not hmac.compare_digest(given.encode(), self.token.encode()):
                return error(401, "missing or wrong bearer token", "unauthorized")
        response: web.StreamResponse = await handler(request)
        return response

    async def healthz(self, _: web.Request) -> web.Response:
        health = GymHealth(
            status="ok",
            instance_id=self.instance_id,
            task=TASK,
            live_episodes=len(self.live),
            episodes_by_phase={"running": len(self.live), "finished": len(self.finished)},
        )
        return web.json_response(health.model_dump(mode="json"))

    async def policy(self, request: web.Request) -> web.Response:
        try:
            body = PolicyAnnouncement.model_validate(await request.json())
        except (ValidationError, ValueError) as problem:
            return error(400, f"invalid {GYM_POLICY_ROUTE} request: {problem}")
        self.announced.update(url.rstrip("/") for url in body.policy_urls)
        return web.json_response(PolicyAnnounced(policy_urls=sorted(self.announced)).model_dump())

    async def run(self, request: web.Request) -> web.Response:
        try:
            body = RunRequest.model_validate(await request.json())
        except (ValidationError, ValueError) as problem:
            return error(400, f"invalid {GYM_RUN_ROUTE} request: {problem}")
        if body.policy_url.rstrip("/") not in self.announced:
            return error(
                403, f"policy_url {body.policy_url} was not announced", "policy_not_announced"
            )
        if body.prompt is None or not isinstance(body.prompt.answer, int):
            return error(400, "times_table needs a prompt set with an integer answer field")
        key = (body.episode_id.rollout_id, body.episode_id.attempt)
        if key in self.finished:  # a lost answer is fetched again, nothing re-run
            return web.json_response(self.finished[key])
        if key in self.live:
            return error(409, f"episode {key} is already running", "conflict")
        self.live.add(key)
        try:
            result = await self.episode(body)
        except PolicyError as problem:
            return error(502, str(problem), "policy_error")
        finally:
            self.live.discard(key)
        self.finished[key] = result
        return web.json_response(result)

    async def episode(self, body: RunRequest) -> dict[str, Any]:
        """Drive one episode: model turn, hint, model turn ... then the reward."""
        assert body.prompt is not None
        product = int(body.prompt.answer)
        tokens = [TOKENIZER.bos_id, *TOKENIZER.encode(body.prompt.text)]
        segments: list[dict[str, Any]] = [{"kind": "prompt", "token_ids": list(tokens)}]
        answers: list[int | None] = []
        finish = "done"
        attempt = body.episode_id.attempt
        row_key = body.episode_id.rollout_id + (f"-a{attempt}" if attempt else "")
        for turn in range(self.max_turns):
            room = self.max_seq_len - len(tokens)
            if room < 1:
                finish = "length"
                break
            out = await self.complete(body, tokens, room, turn, row_key)
            segments.append(
                {
                    "kind": "model",
                    "token_ids": out.token_ids,
                    "logprobs": out.logprobs,
                    "weight_versions": out.weight_versions,
                }
            )
            tokens += out.token_ids
            text_ids, _ = TOKENIZER.strip_eos(out.token_ids)
            match = _NUMBER.match(TOKENIZER.decode(text_ids))
            answers.append(int(match.group()) if match else None)
            if answers[-1] == product or turn + 1 == self.max_turns:
                break
            reply = TOKENIZER.encode(hint(answers[-1], product))
            if len(tokens) + len(reply) >= self.max_seq_len:
                finish = "length"
                break
            segments.append({"kind": "env", "token_ids": reply})
            tokens += reply
        result = {
            "episode_id": body.episode_id.model_dump(),
            "instance_id": self.instance_id,
            "reward": reward(answers, product),
            "segments": segments,
            "turns": len(answers),
            "side_effects": 0,
            "finish_reason": finish,
        }
        return RunResult.model_validate(result).model_dump(mode="json")

    async def complete(
        self, body: RunRequest, tokens: list[int], room: int, turn: int, row_key: str
    ) -> CompletionResult:
        """One model turn: ``POST {policy_url}/v1/completions`` with the run's token."""
        sampling = body.sampling
        request = CompletionRequest(
            prompt_token_ids=list(tokens),
            max_tokens=min(sampling.max_new_tokens or 8, room),
            temperature=1.0 if sampling.temperature is None else sampling.temperature,
            seed=None if sampling.seed is None else turn_seed(sampling.seed, turn),
            weight_version=sampling.weight_version,
            rollout_id=row_key,
            call_index=turn,
        )
        assert self.session is not None
        url = body.policy_url.rstrip("/") + COMPLETIONS_ROUTE
        headers = {"Authorization": f"Bearer {self.token}"}
        try:
            async with self.session.post(
                url, json=request.model_dump(mode="json", exclude_none=True), headers=headers
            ) as response:
                payload = await response.read()
                if response.status != 200:
                    raise PolicyError(f"policy {url} answered {response.status}: {payload[:200]!r}")
            return CompletionResult.model_validate(json.loads(payload))
        except (aiohttp.ClientError, ValueError) as problem:
            raise PolicyError(f"policy {url} failed: {problem!r}") from problem


class PolicyError(RuntimeError):
    """The policy's generation service failed a model turn."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default=os.environ.get(ENV_POD_IP, "127.0.0.1"))
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--instance-id", default=os.environ.get(ENV_GYM_INSTANCE_ID))
    parser.add_argument("--max-turns", type=int, default=2)
    parser.add_argument("--max-seq-len", type=int, default=64, help="policy.maxSeqLen")
    args = parser.parse_args(argv)
    token = os.environ.get(ENV_GYM_TOKEN)
    if not token:
        print(f"times_table: set {ENV_GYM_TOKEN} (the run's token)", file=sys.stderr)
        return 2
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((args.host, args.port))
    host, port = sock.getsockname()[:2]
    server = TimesTable(
        args.instance_id or f"{TASK}-{socket.gethostname()}-{port}",
        token,
        args.max_turns,
        args.max_seq_len,
    )

    async def serve() -> None:
        runner = web.AppRunner(server.app())
        await runner.setup()
        await web.SockSite(runner, sock).start()
        stop = asyncio.Event()
        for signum in (signal.SIGTERM, signal.SIGINT):  # pod deletion: stop cleanly
            asyncio.get_running_loop().add_signal_handler(signum, stop.set)
        print(f"READY http://{host}:{port}", flush=True)
        await stop.wait()
        await runner.cleanup()

    asyncio.run(serve())
    return 0


if __name__ == "__main__":
    sys.exit(main())
