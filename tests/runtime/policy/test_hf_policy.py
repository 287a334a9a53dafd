"""Hugging Face models as the policy: the KV-cached path, the engine, the tokenizer, export.

The models are the tiny Llama- and Qwen2-style ones ``make_tiny_hf`` writes offline (random
weights, a tokenizer trained on the tasks' text); nothing comes from a hub.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from rolloutrun_runtime.contract.run_config import PolicyConfig
from rolloutrun_runtime.policy.engine import RefitError
from rolloutrun_runtime.policy.family import build_policy_model, policy_tokenizer
from rolloutrun_runtime.policy.generation import GenerationEngine, GenerationRequest
from rolloutrun_runtime.policy.hf import HFCausalLM, export_hf
from rolloutrun_runtime.policy.hf_files import HFModelError, local_model_dir
from rolloutrun_runtime.policy.make_tiny_hf import write_model, write_to
from rolloutrun_runtime.policy.model import token_logprobs
from rolloutrun_runtime.storage import CheckpointStorage
from tests.support.gcs_emulator import FakeGcs


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp(request.param)
    write_model(out, request.param, seed=0)
    return out


def _cfg(model_dir: Path, **extra: object) -> PolicyConfig:
    return PolicyConfig.model_validate({"model": str(model_dir), "maxSeqLen": 48, **extra})


def test_cached_path_matches_a_full_forward_with_rows_at_different_positions(
    model_dir: Path,
) -> None:
    model = build_policy_model(_cfg(model_dir, device="cpu"), seed=0)
    assert isinstance(model, HFCausalLM)
    ids = torch.randint(3, model.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        full = model(ids)
        cache = model.new_cache(2, torch.device("cpu"))
        # Row 0 prefills 7 tokens, row 1 only 4 (right-padded), then they decode apart.
        first = model.forward_cached(
            torch.stack([ids[0, :7], torch.cat([ids[1, :4], ids[1, :3] * 0])]),
            torch.tensor([0, 0]),
            cache,
        )
        second = model.forward_cached(
            torch.stack([ids[0, 7:8], ids[1, 4:5]]), torch.tensor([7, 4]), cache
        )
    assert torch.allclose(first[0], full[0, :7], atol=1e-5)
    assert torch.allclose(first[1, :4], full[1, :4], atol=1e-5)
    assert torch.allclose(second[0, 0], full[0, 7], atol=1e-5)
    assert torch.allclose(second[1, 0], full[1, 4], atol=1e-5)


async def test_the_engine_serves_logprobs_versions_pins_and_refits(model_dir: Path) -> None:
    cfg = _cfg(model_dir, device="cpu")
    tokenizer = policy_tokenizer(cfg)
    trained = build_policy_model(cfg, seed=0)
    state0 = {k: v.clone() for k, v in trained.state_dict().items()}
    engine = GenerationEngine(cfg, tokenizer.vocab_size, tokenizer.eos_id, state0, 0, seed=0)
    prompt = [tokenizer.bos_id, *tokenizer.encode("3+4=")]
    try:
        first = await engine.generate(
            GenerationRequest(prompt_token_ids=prompt, max_tokens=6, seed=5)
        )
        # Behaviour logprobs are the full model's logprobs of the sampled tokens.
        ids = torch.tensor([prompt + list(first.token_ids)])
        with torch.inference_mode():
            expected = token_logprobs(trained, ids)[0, len(prompt) - 1 :]
        assert list(first.logprobs) == pytest.approx(expected.tolist(), abs=1e-4)
        assert set(first.weight_versions) == {0}

        with torch.no_grad():
            for value in trained.parameters():
                value.add_(0.05)
        await engine.refit(trained.state_dict(), 1)
        pinned, latest = await asyncio.gather(
            engine.generate(
                GenerationRequest(prompt_token_ids=prompt, max_tokens=6, seed=5, weight_version=0)
            ),
            engine.generate(GenerationRequest(prompt_token_ids=prompt, max_tokens=6, seed=5)),
        )
        assert pinned == first
        assert set(latest.weight_versions) == {1}
        with pytest.raises(RefitError):
            await engine.refit(state0, 1)  # version 1 already holds other weights
    finally:
        await engine.stop()


async def test_the_engine_reads_no_weights_of_its_own_and_shares_none_it_is_given(
    model_dir: Path, tmp_path: Path
) -> None:
    """An engine installs the weights it is handed; reading the model's own was a second
    read of every weight at each engine start (a download per worker pod on gs://)."""
    cfg = _cfg(model_dir, device="cpu")
    tokenizer = policy_tokenizer(cfg)
    trained = build_policy_model(cfg, seed=0)
    with torch.no_grad():
        for value in trained.parameters():
            value.add_(0.05)  # not the files' weights: the engine must serve these
    prompt = [tokenizer.bos_id, *tokenizer.encode("3+4=")]
    call = GenerationRequest(prompt_token_ids=prompt, max_tokens=6, seed=5)
    # The same model without its weight files: only config.json and the tokenizer left.
    bare = tmp_path / "no-weights"
    bare.mkdir()
    for path in model_dir.iterdir():
        if not path.name.endswith(".safetensors"):
            (bare / path.name).write_bytes(path.read_bytes())
    served = []
    for directory in (model_dir, bare):
        engine = GenerationEngine(
            _cfg(directory, device="cpu"),
            tokenizer.vocab_size,
            tokenizer.eos_id,
            trained.state_dict(),
            0,
            seed=0,
        )
        try:
            served.append(await engine.generate(call))
        finally:
            await engine.stop()
    ids = torch.tensor([prompt + list(served[0].token_ids)])
    with torch.inference_mode():
        expected = token_logprobs(trained, ids)[0, len(prompt) - 1 :]
    assert list(served[0].logprobs) == pytest.approx(expected.tolist(), abs=1e-4)
    assert served[1] == served[0]
    # Built around given weights, a model holds copies: never the trainer's own tensors.
    given = trained.state_dict()
    around = build_policy_model(_cfg(bare, device="cpu"), seed=0, weights=given)
    assert {v.data_ptr() for v in around.state_dict().values()}.isdisjoint(
        v.data_ptr() for v in given.values()
    )
    assert all(torch.equal(around.state_dict()[k], v) for k, v in given.items())
    with pytest.raises(HFModelError, match=r"lacks \*.safetensors"):
        build_policy_model(_cfg(bare, device="cpu"), seed=0)


async def test_batch_invariant_hf_engine_is_bit_identical_alone_and_in_a_crowd(
    model_dir: Path,
) -> None:
    cfg = _cfg(model_dir, device="cpu")
    tokenizer = policy_tokenizer(cfg)
    state = build_policy_model(cfg, seed=0).state_dict()
    engine = GenerationEngine(
        cfg, tokenizer.vocab_size, tokenizer.eos_id, state, 0, batch_invariant=True
    )
    try:
        call = GenerationRequest(prompt_token_ids=(1, 9, 10), max_tokens=12, seed=3)
        alone = await engine.generate(call)
        crowd = await asyncio.gather(
            *[
                engine.generate(GenerationRequest(prompt_token_ids=(1, 20 + i), max_tokens=12))
                for i in range(5)
            ],
            engine.generate(call),
        )
        assert crowd[-1] == alone
    finally:
        await engine.stop()


def test_tokenizer_round_trips_the_tasks_text(model_dir: Path) -> None:
    tokenizer = policy_tokenizer(_cfg(model_dir))
    for text in ("3+4=", "12", "g5 c0>", "+3 c3>", "add(-2)"):
        assert tokenizer.decode(tokenizer.encode(text)) == text
    ids, stopped = tokenizer.strip_eos([*tokenizer.encode("7"), tokenizer.eos_id, 5])
    assert stopped and tokenizer.decode(ids) == "7"
    assert (model_dir / "tokenizer_config.json").read_text().count("chat_template") == 1


def test_dtype_is_config(model_dir: Path) -> None:
    model = build_policy_model(_cfg(model_dir, device="cpu", dtype="bfloat16"), seed=0)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.new_cache(1, torch.device("cpu")).dtype == torch.bfloat16
    auto = build_policy_model(_cfg(model_dir, device="cpu"), seed=0)
    assert {p.dtype for p in auto.parameters()} == {torch.float32}


def test_export_writes_the_hf_layout_that_loads_back(model_dir: Path, tmp_path: Path) -> None:
    cfg = _cfg(model_dir, device="cpu")
    model = build_policy_model(cfg, seed=0)
    assert isinstance(model, HFCausalLM)
    with torch.no_grad():
        next(model.parameters()).add_(1.0)
    files = {p.name for p in export_hf(model, str(model_dir), tmp_path / "out")}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= files
    back = build_policy_model(_cfg(tmp_path / "out", device="cpu"), seed=0)
    assert all(
        torch.equal(a, b)
        for a, b in zip(model.state_dict().values(), back.state_dict().values(), strict=True)
    )


def test_bad_model_directories_are_named(tmp_path: Path) -> None:
    with pytest.raises(HFModelError, match=r"lacks config.json, tokenizer.json, \*.safetensors"):
        local_model_dir(str(tmp_path))
    with pytest.raises(HFModelError, match="not a directory"):
        local_model_dir(f"file://{tmp_path}/absent")
    with pytest.raises(HFModelError, match="only a directory, file:// or gs://"):
        local_model_dir("hf://Qwen/Qwen2-0.5B")


def test_a_model_in_gs_storage_is_copied_and_loaded(
    gs_storage: CheckpointStorage,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    fake_gcs: FakeGcs,
) -> None:
    """The script writes into the run's storage; the policy copies it into a local cache."""
    uri = gs_storage.uri_for("models/tiny")
    for name, value in fake_gcs.env().items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("ROLLOUTRUN_MODEL_CACHE", str(tmp_path / "cache"))
    written = write_to(uri, "llama", seed=0)
    assert any(w.endswith("model.safetensors") for w in written)
    directory = local_model_dir(uri)
    assert directory.is_relative_to(tmp_path / "cache")
    assert (directory / "model.safetensors").read_bytes() == gs_storage.read_bytes(
        "models/tiny/model.safetensors"
    )
    # An engine (handed its weights) copies the configs and the tokenizer, not the weights.
    light = local_model_dir(uri, weights=False)
    assert (light / "config.json").is_file() and not any(light.glob("*.safetensors"))


def test_the_gym_tokenizes_an_hf_model_without_torch_and_the_builtin_path_without_transformers(
    model_dir: Path,
) -> None:
    """The Gym only tokenizes: loading a model directory's tokenizer there imports neither
    torch nor transformers; the trainer's and engine's modules do not import transformers
    until a Hugging Face model is built."""
    import subprocess
    import sys

    probe = (
        "import sys\n"
        "import rolloutrun_runtime.environments.gym.server\n"
        "from rolloutrun_runtime.contract.run_config import PolicyConfig\n"
        "from rolloutrun_runtime.policy.tokenizer import policy_tokenizer\n"
        f"tok = policy_tokenizer(PolicyConfig(model={str(model_dir)!r}))\n"
        "assert tok.decode(tok.encode('3+4=')) == '3+4='\n"
        f"chat = {{'model': {str(model_dir)!r}, 'chatTemplate': True}}\n"
        "chat = policy_tokenizer(PolicyConfig.model_validate(chat))\n"
        "assert chat.decode(chat.encode_prompt('3+4=')).endswith('assistant: ')\n"
        "gym = sorted(m for m in ('torch', 'transformers') if m in sys.modules)\n"
        "import rolloutrun_runtime.trainer, rolloutrun_runtime.policy.engine\n"
        "import rolloutrun_runtime.workers.inprocess\n"
        "print(gym, 'transformers' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.split("\n")[0] == "[] False", out.stdout + out.stderr
