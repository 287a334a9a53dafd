"""Runtime throughput: step time, generation tokens/s, and the controller's overhead share.

Runs a short GRPO run of an example (default ``examples/tiny-grpo.yaml``) with real Gym
replicas as local processes and the configured worker backend, and, in the same process
and before it, a baseline: the same generation workers driven directly with concurrent
``/v1/completions`` calls (no Gym, no controller). Prints one JSON object:

- ``step_time_s``: mean wall time of a train step (after a warm-up step);
- ``generation_tokens_per_s``: model tokens the run generated per wall second;
- ``baseline_generation_tokens_per_s`` and ``generation_efficiency`` (run / baseline);
- ``controller_overhead_share``: the share of step time spent in the controller's own
  bookkeeping (admission, dispatch records, result parsing, finalization, selection,
  batch assembly, commit), i.e. outside model compute and environment work;
- ``train_compute_share``, ``refit_share``: the train step's model compute and refits;
- ``hf_baseline_generation_tokens_per_s``: the same workers' baseline with a Hugging Face
  policy (the tiny Llama-style model ``make_tiny_hf`` writes, or ``--hf-model DIR``) in
  place of the built-in model, measured in the same process (``--no-hf`` skips it).

Usage: ``python -m bench.runtime_throughput [--config FILE] [--steps N] [--hf-model DIR]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from rolloutrun_runtime.contract.pod import ENV_GYM_TOKEN
from rolloutrun_runtime.contract.run_config import RunConfig, load_run_config
from rolloutrun_runtime.launcher import start_gym, stop_process
from rolloutrun_runtime.policy.family import build_policy_model, policy_tokenizer
from rolloutrun_runtime.policy.http import bearer_headers
from rolloutrun_runtime.tasks import make_problem
from rolloutrun_runtime.trainer import run_trainer
from rolloutrun_runtime.workers import build_workers

ROOT = Path(__file__).resolve().parent.parent


async def generation_baseline(cfg: RunConfig, calls: int) -> float:
    """Tokens/s of the workers alone, at the concurrency the run uses."""
    model = build_policy_model(cfg.policy, cfg.seed)
    tokenizer = policy_tokenizer(cfg.policy)
    workers = build_workers(cfg, model.state_dict(), 0)
    await workers.start()
    concurrency = cfg.rollout.max_in_flight_groups * cfg.grpo.group_size
    limiter = asyncio.Semaphore(concurrency)
    tokens = 0

    async def one(session: aiohttp.ClientSession, index: int) -> None:
        nonlocal tokens
        problem = make_problem(cfg.task, cfg.seed, index % cfg.task.dataset_size)
        body = {
            "prompt_token_ids": [tokenizer.bos_id, *tokenizer.encode(problem.prompt_text)],
            "max_tokens": cfg.task.max_new_tokens,
            "temperature": cfg.policy.temperature,
            "seed": index,
        }
        url = workers.endpoints[index % len(workers.endpoints)]
        async with limiter, session.post(f"{url}/v1/completions", json=body) as response:
            tokens += len((await response.json())["token_ids"])

    try:
        async with aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0),
            headers=bearer_headers(os.environ[ENV_GYM_TOKEN]),
        ) as session:
            await asyncio.gather(*(one(session, i) for i in range(min(64, calls))))  # warm-up
            tokens = 0
            started = time.perf_counter()
            await asyncio.gather(*(one(session, i) for i in range(calls)))
            elapsed = time.perf_counter() - started
    finally:
        await workers.stop()
    return tokens / elapsed


def hf_generation_baseline(cfg: RunConfig, calls: int, model_dir: str | None, tmp: Path) -> float:
    """``generation_baseline`` with a Hugging Face policy (written offline unless given)."""
    if model_dir is None:
        from rolloutrun_runtime.policy.make_tiny_hf import write_model

        write_model(tmp / "tiny-hf-model", "llama", seed=0)
        model_dir = str(tmp / "tiny-hf-model")
    policy = cfg.policy.model_copy(update={"model": model_dir})
    return asyncio.run(generation_baseline(cfg.model_copy(update={"policy": policy}), calls))


def summarize(history: list[dict[str, Any]]) -> dict[str, Any]:
    steady = history[1:] or history
    wall = sum(r["step_time_s"] for r in steady)
    return {
        "step_time_s": statistics.fmean(r["step_time_s"] for r in steady),
        "step_time_p50_s": statistics.median(r["step_time_s"] for r in steady),
        "generation_tokens_per_s": sum(r["generated_tokens"] for r in steady) / wall,
        "controller_overhead_share": sum(r["controller_overhead_s"] for r in steady) / wall,
        "train_compute_share": sum(r["train_compute_s"] for r in steady) / wall,
        "refit_share": sum(r["refit_s"] for r in steady) / wall,
        "rollouts_per_step": statistics.fmean(r["rollouts"] for r in steady),
        "batch_age": statistics.fmean(r["batch_age"] for r in steady),
        "reward_first": history[0]["reward_mean"],
        "reward_last": history[-1]["reward_mean"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(ROOT / "examples" / "tiny-grpo.yaml"))
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--hf-model", default=None, help="a Hugging Face model directory")
    parser.add_argument("--no-hf", action="store_true", help="skip the Hugging Face baseline")
    args = parser.parse_args(argv)
    config_file = Path(args.config)
    cfg = load_run_config(config_file)
    # The run's data-plane token, as `rolloutrun launch` sets it: the workers, the Gym
    # replicas (children) and the trainer share it.
    os.environ.setdefault(ENV_GYM_TOKEN, secrets.token_hex(16))
    with tempfile.TemporaryDirectory(prefix="rolloutrun-bench-") as tmp:
        log_dir = Path(tmp)
        grpo = cfg.grpo.model_copy(update={"max_steps": args.steps})
        cfg = cfg.model_copy(update={"log_dir": str(log_dir), "grpo": grpo})
        calls = args.steps * cfg.grpo.prompts_per_step * cfg.grpo.group_size
        baseline = asyncio.run(generation_baseline(cfg, calls))
        hf_baseline = (
            None if args.no_hf else hf_generation_baseline(cfg, calls, args.hf_model, log_dir)
        )
        gyms = [start_gym(config_file, log_dir, i) for i in range(cfg.gym.replicas)]
        try:
            gym = cfg.gym.model_copy(update={"endpoints": [g.url for g in gyms]})
            cfg = cfg.model_copy(update={"gym": gym})
            started = time.perf_counter()
            result = asyncio.run(run_trainer(cfg))
            total = time.perf_counter() - started
        finally:
            for process in gyms:
                stop_process(process.process)
                process.log.close()
    report = {
        "benchmark": "runtime_throughput",
        "config": str(config_file),
        "steps": result.steps,
        "backend": cfg.workers.backend.value,
        "run_wall_s": total,
        **summarize(result.history),
        "baseline_generation_tokens_per_s": baseline,
        "hf_baseline_generation_tokens_per_s": hf_baseline,
    }
    report["generation_efficiency"] = report["generation_tokens_per_s"] / baseline
    json.dump(report, sys.stdout, indent=1, sort_keys=True)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
