"""Gym servers over real HTTP against a real generation server.

The policy runs the real TinyCausalLM and engine; for multi-turn episodes its weights are
a bigram script (``>`` → ``+1``), so every turn applies a known side effect.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from rolloutrun_runtime.contract.run_config import RunConfig
from rolloutrun_runtime.environments.gym import (
    AgentLoop,
    Episode,
    GymServer,
    HttpPolicyClient,
    Phase,
    SideEffectLog,
    SideEffectReplayError,
    make_env,
    score,
)
from rolloutrun_runtime.environments.gym.effects import AuditFileBusyError
from rolloutrun_runtime.policy.generation import (
    GenerationEngine,
    build_generation_app,
    serve_app,
)
from rolloutrun_runtime.policy.model import build_model
from rolloutrun_runtime.policy.scripted import PLUS_ONE_SCRIPT, scripted_state_dict
from rolloutrun_runtime.policy.tokenizer import TOKENIZER
from rolloutrun_runtime.tasks import ArithmeticProblem, ReachTargetProblem, make_problem
from tests.support.cli import ROLLOUTRUN, reaped
from tests.support.data_plane import HEADERS, announce

ARITH = RunConfig.model_validate({"policy": {"device": "cpu"}, "seed": 3})
REACH = RunConfig.model_validate(
    {
        "policy": {"device": "cpu"},
        "seed": 3,
        "task": {"name": "reach_target", "maxOperand": 3, "maxTurns": 4, "turnDelayMs": 5},
        "gym": {"requestMaxBytes": 2048},
    }
)


class Http:
    def __init__(self, session: aiohttp.ClientSession) -> None:
        self.session = session

    async def post(self, url: str, body: Any, expect: int = 200) -> dict[str, Any]:
        """POST as the trainer does: with the run's token, and a ``/run`` only after
        announcing its ``policy_url``."""
        policy_url = body.get("policy_url") if isinstance(body, dict) else None
        if url.endswith("/run") and str(policy_url).startswith("http"):
            await announce(self.session, url.removesuffix("/run"), str(policy_url))
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        headers = {"Content-Type": "application/json", **HEADERS}
        async with self.session.post(url, data=data, headers=headers) as response:
            payload = await response.json()
            assert response.status == expect, payload
            return payload

    async def get(self, url: str, expect: int = 200) -> dict[str, Any]:
        async with self.session.get(url, headers=HEADERS) as response:
            payload = await response.json()
            assert response.status == expect, payload
            return payload


@pytest.fixture
async def http() -> AsyncIterator[Http]:
    async with aiohttp.ClientSession() as session:
        yield Http(session)


async def _policy(cfg: RunConfig, scripted: bool) -> tuple[GenerationEngine, Any, str]:
    state = (
        scripted_state_dict(cfg.policy, PLUS_ONE_SCRIPT)
        if scripted
        else build_model(cfg.policy, TOKENIZER.vocab_size, seed=cfg.seed).state_dict()
    )
    engine = GenerationEngine(cfg.policy, TOKENIZER.vocab_size, TOKENIZER.eos_id, state, 0)
    runner, url = await serve_app(build_generation_app(engine))
    return engine, runner, url


StartGym = Callable[..., Awaitable[tuple[GymServer, str]]]


@pytest.fixture
async def start_gym() -> AsyncIterator[StartGym]:
    runners = []

    async def start(
        cfg: RunConfig, instance_id: str = "gym-0", audit: Path | None = None
    ) -> tuple[GymServer, str]:
        server = GymServer(instance_id, cfg, audit)
        runner, url = await serve_app(server.app)
        runners.append(runner)
        return server, url

    yield start
    for runner in runners:
        await runner.cleanup()


def _run_body(rollout_id: str, prompt_id: int, policy_url: str, **extra: Any) -> dict[str, Any]:
    return {
        "episode_id": {"rollout_id": rollout_id, "attempt": 0},
        "prompt_id": prompt_id,
        "policy_url": policy_url,
        "sampling": {"temperature": 1.0, "max_new_tokens": 8, "seed": 100 + prompt_id},
        **extra,
    }


async def test_arithmetic_episodes_end_to_end(http: Http, start_gym: StartGym) -> None:
    _, runner, policy_url = await _policy(ARITH, scripted=False)
    try:
        _, gym = await start_gym(ARITH, "gym-a")
        results = await asyncio.gather(
            *[http.post(gym + "/run", _run_body(f"r{i}", i, policy_url)) for i in range(6)]
        )
        for i, result in enumerate(results):
            problem = make_problem(ARITH.task, ARITH.seed, i)
            prompt, model = result["segments"]
            assert prompt == {
                "kind": "prompt",
                "token_ids": [TOKENIZER.bos_id, *TOKENIZER.encode(problem.prompt_text)],
            }
            assert model["kind"] == "model" and 1 <= len(model["token_ids"]) <= 8
            assert (
                len(model["logprobs"]) == len(model["weight_versions"]) == len(model["token_ids"])
            )
            assert set(model["weight_versions"]) == {0}
            assert result["instance_id"] == "gym-a"
            assert result["turns"] == result["side_effects"] == 1
            assert result["finish_reason"] == "done"
            # The reward is the verifier's score of what the model said.
            text_ids, stopped = TOKENIZER.strip_eos(model["token_ids"])
            text = TOKENIZER.decode(text_ids)
            assert isinstance(problem, ArithmeticProblem)
            digits = len(text) - len(text.lstrip("-0123456789"))
            value = int(text[:digits]) if digits and text[:digits] != "-" else None
            clean = value is not None and stopped and digits == len(text)
            state = {"a": problem.a, "b": problem.b, "submitted": value, "clean": clean}
            assert result["reward"] == pytest.approx(score(ARITH.task, state))
            # The policy captured the call under the episode's row key, turn 0.
            capture = await http.get(f"{policy_url}/token-capture/rollouts/r{i}")
            assert capture["calls"][0]["prompt_token_ids"] == prompt["token_ids"]
            assert capture["calls"][0]["token_ids"] == model["token_ids"]
        # Same seed, same prompt: the same tokens on a fresh episode id.
        again = await http.post(gym + "/run", _run_body("r0-again", 0, policy_url))
        first, repeat = results[0]["segments"][1], again["segments"][1]
        assert repeat["token_ids"] == first["token_ids"]
        assert repeat["logprobs"] == pytest.approx(first["logprobs"], abs=1e-5)
    finally:
        await runner.cleanup()


async def test_reach_target_multi_turn_exactly_once_with_durable_audit(
    http: Http, start_gym: StartGym, tmp_path: Path
) -> None:
    audit = tmp_path / "audit" / "gym-r.jsonl"
    _, runner, policy_url = await _policy(REACH, scripted=True)
    try:
        server, gym = await start_gym(REACH, "gym-r", audit)
        ids = range(8)
        results = await asyncio.gather(
            *[http.post(gym + "/run", _run_body(f"m{i}", i, policy_url)) for i in ids]
        )
        lines = [json.loads(line) for line in audit.read_text().splitlines()]
        for i, result in zip(ids, results, strict=True):
            problem = make_problem(REACH.task, REACH.seed, i)
            assert isinstance(problem, ReachTargetProblem)
            # "+1" per turn reaches targets 1..3 in `target` turns, each one side effect.
            assert result["turns"] == result["side_effects"] == problem.target
            assert result["reward"] == 1.0 and result["finish_reason"] == "done"
            kinds = [s["kind"] for s in result["segments"]]
            assert kinds == ["prompt"] + ["model", "env"] * (problem.target - 1) + ["model"]
            texts = [TOKENIZER.decode(s["token_ids"]) for s in result["segments"]]
            assert texts[1::2] == ["+1"] * problem.target
            assert texts[2::2] == [f" c{k}>" for k in range(1, problem.target)]
            mine = [entry for entry in lines if entry["rollout_id"] == f"m{i}"]
            assert [e["revision"] for e in mine] == list(range(1, problem.target + 1))
            assert [e["turn"] for e in mine] == list(range(problem.target))
            assert {e["instance_id"] for e in mine} == {"gym-r"}
            assert all(e["effect"] == {"op": "add", "k": 1, "clean": True} for e in mine)
            state = await http.get(f"{gym}/episodes/m{i}")
            (record,) = state["episodes"]
            assert record["state"]["counter"] == problem.target
            assert record["revision"] == problem.target == state["applied_revision"]
            assert [a["revision"] for a in record["audit"]] == [e["revision"] for e in mine]
        keys = Counter((e["rollout_id"], e["revision"]) for e in lines)
        assert max(keys.values()) == 1, "a side effect was applied twice"

        # Asking again for a finished episode returns its result and applies nothing.
        repeat = await http.post(gym + "/run", _run_body("m0", 0, policy_url))
        assert repeat == results[0]
        assert len(audit.read_text().splitlines()) == len(lines)

        # A restarted replica reloads the audit and refuses to replay a revision, e.g. a
        # stale record restored under attempt 1 from before its first side effect.
        record = (await http.get(f"{gym}/episodes/m5"))["episodes"][0]
        stale = Episode.from_record(record, attempt=1)
        stale.phase, stale.turn, stale.revision, stale.state["counter"] = (
            Phase.AWAIT_MODEL,
            0,
            0,
            0,
        )
        stale.segments = stale.segments[:1]
        # One writer per audit file: a second one is refused while the replica lives.
        with pytest.raises(AuditFileBusyError, match="another writer holds"):
            SideEffectLog("gym-r", audit)
        server.effects.close()  # the replica stops (its pod is replaced)
        reopened = SideEffectLog("gym-r", audit)
        assert reopened.applied_revision("m5") == record["revision"]
        async with aiohttp.ClientSession() as session:
            loop = AgentLoop(
                REACH.task,
                REACH.seed,
                REACH.policy.max_seq_len,
                HttpPolicyClient(session, 10),
                reopened,
            )
            with pytest.raises(SideEffectReplayError, match="revision 1 was already applied"):
                await loop.run(stale)
        reopened.close()
        assert stale.phase is Phase.FAILED
        assert len(audit.read_text().splitlines()) == len(lines)
        assert server.effects.applied_revision("m5") == record["revision"]
    finally:
        await runner.cleanup()


async def test_bad_requests_are_4xx_and_leave_other_episodes_untouched(
    http: Http, start_gym: StartGym, tmp_path: Path
) -> None:
    audit = tmp_path / "audit.jsonl"
    slow = REACH.model_copy(deep=True)
    slow.task.turn_delay_ms = 60
    _, runner, policy_url = await _policy(slow, scripted=True)
    try:
        _, gym = await start_gym(slow, "gym-b", audit)
        run = gym + "/run"
        # prompt 2's target (seed 3) needs 3 turns of 60 ms: it is live during the checks.
        assert make_problem(slow.task, slow.seed, 2) == ReachTargetProblem(2, "g3 c0>", 3)
        live = asyncio.create_task(http.post(run, _run_body("live", 2, policy_url)))
        while not (await http.get(gym + "/healthz"))["live_episodes"]:
            await asyncio.sleep(0.005)
        bad: list[tuple[Any, int, str]] = [
            (b"{nope", 400, "not valid JSON"),
            (b"[]", 400, "must be a JSON object"),
            ({"episode_id": {"rollout_id": "x", "attempt": 0}}, 400, "prompt_id: Field required"),
            (_run_body("x", 0, policy_url, task="chess"), 400, "unknown task 'chess'"),
            (_run_body("x", 10_000, policy_url), 400, "outside the dataset"),
            (_run_body("x-a2", 0, policy_url), 400, "may not end in '-a<N>'"),
            (_run_body("x", 0, "ftp://nowhere"), 400, "policy_url"),
            (_run_body("x", 0, policy_url, extra=1), 400, "extra"),
            ({**_run_body("x", 0, policy_url), "prompt_id": True}, 400, "prompt_id"),
            (_run_body("x" * 300, 0, policy_url), 400, "rollout_id"),
            (
                {**_run_body("x", 0, policy_url), "pad": "z" * 4096},
                413,
                "gym.requestMaxBytes (2048 bytes)",
            ),
            (_run_body("live", 2, policy_url), 409, "episode live is already running"),
        ]
        for body, status, needle in bad:
            payload = await http.post(run, body, expect=status)
            assert needle in payload["error"]["message"], (needle, payload)
        # A policy that is down fails its own episode with 502, and only that one.
        down = await http.post(run, _run_body("down", 3, "http://127.0.0.1:9"), expect=502)
        assert "episode down failed" in down["error"]["message"]
        assert (await http.get(gym + "/episodes/down"))["episodes"][0]["phase"] == "failed"
        await http.post(run, _run_body("down", 3, policy_url), expect=409)

        result = await live
        assert result["reward"] == 1.0 and result["side_effects"] == 3
        entries = [json.loads(line) for line in audit.read_text().splitlines()]
        assert [(e["rollout_id"], e["revision"]) for e in entries] == [
            ("live", r) for r in (1, 2, 3)
        ]
        # An older attempt than one the server has seen is refused.
        newer = _run_body("gen", 0, policy_url)
        newer["episode_id"]["attempt"] = 2
        await http.post(run, newer, expect=200)
        stale = await http.post(run, _run_body("gen", 0, policy_url), expect=409)
        assert "superseded by attempt 2" in stale["error"]["message"]
        await http.get(gym + "/episodes/unknown", expect=404)
    finally:
        await runner.cleanup()


def test_gym_entry_point_prints_ready_and_stops_on_sigterm(tmp_path: Path) -> None:
    config = tmp_path / "run.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "rolloutrun.dev/v1alpha1",
                "kind": "RolloutRun",
                "metadata": {"name": "demo"},
                "spec": {"run": {"task": {"name": "reach_target"}}},
            }
        )
    )
    command = [*ROLLOUTRUN, "gym", "--config", str(config), "--port", "0"]
    command += ["--instance-id", "gym-7", "--audit-file", str(tmp_path / "audit.jsonl")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(["runtime", "operator"])}
    with reaped(subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=env)) as process:
        assert process.stdout is not None
        line = process.stdout.readline().strip()
        assert line.startswith("READY http://127.0.0.1:"), line
        url = line.split()[1]

        async def health() -> dict[str, Any]:
            async with aiohttp.ClientSession() as session, session.get(url + "/healthz") as r:
                return await r.json()

        health_body = asyncio.run(health())
        assert health_body["instance_id"] == "gym-7"
        assert health_body["task"] == "reach_target"
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=20) == 0
    bad = subprocess.run(
        [*command[:5], str(tmp_path / "missing.yaml"), "--port", "0"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert bad.returncode == 2 and "no such file" in bad.stderr


def test_verifier_rewards_are_shaped_and_bounded() -> None:
    arith = make_env(ARITH.task)
    problem = make_problem(ARITH.task, ARITH.seed, 0)
    assert isinstance(problem, ArithmeticProblem)

    def reward(text: str, stopped: bool = True) -> float:
        state = arith.start(problem)
        arith.apply(state, arith.interpret(state, text, stopped))
        return arith.score(state)

    answer = str(problem.answer)
    ranked = [reward("x"), reward(str(problem.answer + 9) + "zz"), reward(answer + "zz")]
    ranked.append(reward(answer))
    assert ranked == sorted(set(ranked)) and ranked[0] == 0.0 and ranked[-1] == 1.0
    assert reward(answer, stopped=False) == reward(answer + "zz")  # not clean either way

    reach = make_env(REACH.task)
    target = make_problem(REACH.task, REACH.seed, 2)
    assert isinstance(target, ReachTargetProblem) and target.target == 3

    def play(moves: list[str]) -> float:
        state = reach.start(target)
        for move in moves:
            outcome = reach.apply(state, reach.interpret(state, move, True))
            if outcome.done:
                break
        return reach.score(state)

    assert play(["+3"]) == play(["add(1)", "2"]) == 1.0
    assert 0.0 <= play(["zz"] * 4) < play(["+1"] * 1 + ["zz"] * 3) < play(["+2", "zz", "zz", "zz"])
    assert play(["+9"]) < play(["+2", "zz", "zz", "zz"])  # out of range: no move
    for moves in (["-3", "-3", "-3", "-3"], ["+3"], ["x"]):
        assert 0.0 <= play(moves) <= 1.0
