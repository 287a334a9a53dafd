"""A Hugging Face policy's chat template (``policy.chatTemplate``), its several stop tokens
(``eos_token_id`` lists) and a model directory that is not there yet.

The models are ``make_tiny_hf``'s (random weights, a tokenizer trained offline) and, for the
ChatML case, that tokenizer with Qwen2's ``<|im_start|>``/``<|im_end|>`` added; nothing
comes from a hub.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from rolloutrun_runtime.cli import main as cli_main
from rolloutrun_runtime.contract.run_config import UNRESTORABLE_EXIT_CODE, PolicyConfig, RunConfig
from rolloutrun_runtime.environments.gym import (
    AgentLoop,
    EpisodeId,
    LocalPolicyClient,
    Sampling,
    SideEffectLog,
)
from rolloutrun_runtime.policy.family import build_policy_model, policy_tokenizer
from rolloutrun_runtime.policy.generation import GenerationEngine, GenerationRequest
from rolloutrun_runtime.policy.hf_files import HFModelError, HFTokenizer
from rolloutrun_runtime.policy.make_tiny_hf import BOS, EOS, write_model
from rolloutrun_runtime.tasks import make_problem

#: Qwen2-instruct's ChatML template (with its system default and raise_exception guard).
CHATML = (
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + message['role']) }}{% endif %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny")
    write_model(out, "qwen2", seed=0)
    return out


def _copy(tiny: Path, out: Path) -> Path:
    shutil.copytree(tiny, out)
    return out


def _settings(directory: Path, **changes: object) -> None:
    path = directory / "tokenizer_config.json"
    settings = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            settings.pop(key, None)
        else:
            settings[key] = value
    path.write_text(json.dumps(settings))


def _cfg(directory: Path, chat: bool) -> PolicyConfig:
    return PolicyConfig.model_validate(
        {"model": str(directory), "chatTemplate": chat, "maxSeqLen": 64, "device": "cpu"}
    )


# ------------------------------------------------------------------ the chat template
def test_off_by_default_prompts_stay_raw_after_a_bos(tiny: Path) -> None:
    tokenizer = policy_tokenizer(_cfg(tiny, chat=False))
    assert PolicyConfig().chat_template is False
    assert tokenizer.encode_prompt("3+4=") == [tokenizer.bos_id, *tokenizer.encode("3+4=")]


def test_the_tiny_models_template_renders_one_user_message(tiny: Path) -> None:
    tokenizer = policy_tokenizer(_cfg(tiny, chat=True))
    ids = tokenizer.encode_prompt("3+4=")
    assert ids == tokenizer.encode("user: 3+4=\nassistant: ")
    assert tokenizer.decode(ids) == "user: 3+4=\nassistant: "


def test_a_chatml_template_marks_the_turns_with_special_tokens(tiny: Path, tmp_path: Path) -> None:
    directory = _copy(tiny, tmp_path / "chatml")
    base = HFTokenizer(directory)
    base.tokenizer.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    base.tokenizer.save(str(directory / "tokenizer.json"))
    _settings(directory, chat_template=CHATML, eos_token="<|im_end|>", bos_token=None)
    tokenizer = policy_tokenizer(_cfg(directory, chat=True))
    start, end = (base.tokenizer.token_to_id(t) for t in ("<|im_start|>", "<|im_end|>"))
    ids = tokenizer.encode_prompt("3+4=")
    assert ids[0] == start and ids.count(start) == 3 and ids.count(end) == 2
    assert tokenizer.decode(ids, skip_special=False) == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\n3+4=<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tokenizer.eos_id == end


async def test_the_gym_agent_prompts_through_the_template(tiny: Path) -> None:
    """The agent loop's prompt segment is the rendered prompt; the episode still runs."""
    cfg = RunConfig.model_validate(
        {"policy": {"model": str(tiny), "chatTemplate": True, "maxSeqLen": 64, "device": "cpu"}}
    )
    tokenizer = policy_tokenizer(cfg.policy)
    state = build_policy_model(cfg.policy, seed=0).state_dict()
    engine = GenerationEngine(cfg.policy, tokenizer.vocab_size, tokenizer.eos_id, state, 0)
    loop = AgentLoop(
        cfg.task,
        cfg.seed,
        cfg.policy.max_seq_len,
        LocalPolicyClient(engine.generate),
        SideEffectLog("chat"),
        tokenizer=tokenizer,
    )
    try:
        episode = loop.new_episode(EpisodeId("p3"), 3, "", Sampling(1.0, 4, seed=1))
        text = make_problem(cfg.task, cfg.seed, 3).prompt_text
        assert episode.segments[0].token_ids == tokenizer.encode(f"user: {text}\nassistant: ")
        await loop.run(episode)
        assert episode.reward is not None
    finally:
        await engine.stop()


def test_the_switch_needs_a_template_and_a_model(tiny: Path, tmp_path: Path) -> None:
    bare = _copy(tiny, tmp_path / "bare")
    _settings(bare, chat_template=None)
    with pytest.raises(HFModelError, match=re.escape(f"policy.model {bare} has no chat_template")):
        policy_tokenizer(_cfg(bare, chat=True))
    with pytest.raises(ValidationError, match=r"chatTemplate needs policy\.model"):
        PolicyConfig.model_validate({"chatTemplate": True})


def test_templates_see_the_named_special_tokens(tiny: Path, tmp_path: Path) -> None:
    llama3 = _copy(tiny, tmp_path / "llama3")
    _settings(
        llama3,
        chat_template="{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% break %}"
        "{% endfor %}{{ eos_token }}",
    )
    tokenizer = policy_tokenizer(_cfg(llama3, chat=True))
    assert tokenizer.encode_prompt("1+1=") == [
        tokenizer.bos_id,
        *tokenizer.encode("1+1="),
        tokenizer.eos_id,
    ]
    quoting = _copy(tiny, tmp_path / "quoting")
    _settings(quoting, chat_template="{{ messages[0] | tojson }}")
    rendered = policy_tokenizer(_cfg(quoting, chat=True)).encode_prompt("a<b")
    assert rendered == tokenizer.encode('{"role": "user", "content": "a<b"}')


def test_templates_render_sandboxed_and_may_refuse(tiny: Path, tmp_path: Path) -> None:
    refusing = _copy(tiny, tmp_path / "refusing")
    _settings(refusing, chat_template="{{ raise_exception('system messages only') }}")
    with pytest.raises(HFModelError, match="refused the prompt: system messages only"):
        policy_tokenizer(_cfg(refusing, chat=True)).encode_prompt("1+1=")
    escaping = _copy(tiny, tmp_path / "escaping")
    _settings(escaping, chat_template="{{ ''.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(HFModelError, match="chat template failed"):
        policy_tokenizer(_cfg(escaping, chat=True)).encode_prompt("1+1=")


# ------------------------------------------------------------------ stop tokens
def test_stop_tokens_come_from_generation_and_model_configs(tiny: Path, tmp_path: Path) -> None:
    directory = _copy(tiny, tmp_path / "stops")
    base = HFTokenizer(tiny)
    eos, bos = base.tokenizer.token_to_id(EOS), base.tokenizer.token_to_id(BOS)
    assert base.stop_ids == {eos}
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos, 40]}))
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "eos_token_id": 41}))
    tokenizer = policy_tokenizer(_cfg(directory, chat=False))
    assert tokenizer.stop_ids == {eos, 40, 41}
    assert tokenizer.strip_eos([bos, 7, 41, 9, eos]) == ([bos, 7], True)
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": "x"}))
    with pytest.raises(HFModelError, match="eos_token_id 'x' is not a token id"):
        HFTokenizer(directory)


async def test_the_engine_stops_on_any_of_the_models_eos_ids(tiny: Path, tmp_path: Path) -> None:
    cfg = _cfg(tiny, chat=False)
    tokenizer = policy_tokenizer(cfg)
    state = build_policy_model(cfg, seed=0).state_dict()
    call = GenerationRequest(prompt_token_ids=(tokenizer.bos_id, 9, 10), max_tokens=8, seed=3)
    plain = GenerationEngine(cfg, tokenizer.vocab_size, tokenizer.eos_id, state, 0, seed=0)
    try:
        free = await plain.generate(call)
    finally:
        await plain.stop()
    # The third token sampled becomes a second eos_token_id (absent from the two before it).
    third = free.token_ids[2]
    assert free.finish_reason == "length" and third not in free.token_ids[:2]
    directory = _copy(tiny, tmp_path / "multi-eos")
    (directory / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [tokenizer.eos_id, third]})
    )
    multi = policy_tokenizer(_cfg(directory, chat=False))
    engine = GenerationEngine(
        cfg, multi.vocab_size, multi.eos_id, state, 0, seed=0, stop_ids=multi.stop_ids
    )
    try:
        stopped = await engine.generate(call)
    finally:
        await engine.stop()
    assert stopped.finish_reason == "stop"
    assert list(stopped.token_ids) == list(free.token_ids[:3])


# ------------------------------------------------------------------ a missing model
def _run_file(tmp_path: Path, model: Path) -> Path:
    example = yaml.safe_load(Path("examples/tiny-hf.yaml").read_text())
    example["spec"]["run"]["policy"]["model"] = str(model)
    example["spec"]["run"]["logDir"] = str(tmp_path / "logs")
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(example))
    return path


def test_train_and_run_without_the_model_stop_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "tiny-hf-model"
    missing.mkdir()  # made, but make_tiny_hf never ran
    run_file = _run_file(tmp_path, missing)
    for argv in (["train", str(run_file)], ["run", str(run_file)]):
        assert cli_main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1, err
        assert f"{missing} lacks config.json, tokenizer.json, *.safetensors" in err
        assert f"python -m rolloutrun_runtime.policy.make_tiny_hf {missing}" in err
    assert not (tmp_path / "logs").exists()  # nothing started


def test_the_trainer_pod_exits_unrestorable_so_the_operator_does_not_loop(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_file = _run_file(tmp_path, tmp_path / "nowhere")
    assert cli_main(["trainer", "--config", str(run_file)]) == UNRESTORABLE_EXIT_CODE
    err = capsys.readouterr().err
    assert f"{tmp_path / 'nowhere'} is not a directory" in err and "make_tiny_hf" in err
