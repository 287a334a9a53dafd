"""Tokenizer round trip, task problems, and the model's shapes, determinism and cache."""

from __future__ import annotations

import pytest
import torch

from rolloutrun_runtime.contract.run_config import PolicyConfig, TaskConfig, TaskName
from rolloutrun_runtime.policy.model import (
    ModelError,
    build_model,
    state_sha256,
    token_logprobs,
)
from rolloutrun_runtime.policy.tokenizer import TOKENIZER, TokenizerError
from rolloutrun_runtime.tasks import (
    ArithmeticProblem,
    ReachTargetProblem,
    TaskError,
    make_problem,
)


def test_tokenizer_round_trip_and_specials() -> None:
    text = "12+7=19 g5 c0>+3 add(-2)"
    ids = TOKENIZER.encode(text)
    assert TOKENIZER.decode(ids) == text
    assert min(ids) >= 3 and max(ids) < TOKENIZER.vocab_size
    framed = [TOKENIZER.bos_id, *ids, TOKENIZER.eos_id, TOKENIZER.pad_id]
    assert TOKENIZER.decode(framed) == text
    assert TOKENIZER.decode(framed, skip_special=False) == f"<bos>{text}<eos><pad>"
    assert TOKENIZER.strip_eos([*ids, TOKENIZER.eos_id, 5]) == (ids, True)
    with pytest.raises(TokenizerError, match="'Z'"):
        TOKENIZER.encode("Z")
    with pytest.raises(TokenizerError, match="outside the vocabulary"):
        TOKENIZER.decode([TOKENIZER.vocab_size])


def test_problems_rebuild_identically_and_differ_by_seed() -> None:
    task = TaskConfig()
    first = [make_problem(task, 7, i) for i in range(50)]
    assert first == [make_problem(task, 7, i) for i in range(50)]
    assert first != [make_problem(task, 8, i) for i in range(50)]
    for problem in first:
        assert isinstance(problem, ArithmeticProblem)
        assert 0 <= problem.a <= task.max_operand and 0 <= problem.b <= task.max_operand
        assert problem.prompt_text == f"{problem.a}+{problem.b}="
        TOKENIZER.encode(problem.prompt_text)
    reach = make_problem(TaskConfig(name=TaskName.REACH_TARGET, max_operand=5), 0, 3)
    assert isinstance(reach, ReachTargetProblem) and 1 <= reach.target <= 5
    assert reach.prompt_text == f"g{reach.target} c0>"
    with pytest.raises(TaskError, match="outside the dataset"):
        make_problem(task, 0, task.dataset_size)


def test_model_shapes_determinism_and_kv_cache() -> None:
    cfg = PolicyConfig(device="cpu")
    model = build_model(cfg, TOKENIZER.vocab_size, seed=3)
    again = build_model(cfg, TOKENIZER.vocab_size, seed=3)
    other = build_model(cfg, TOKENIZER.vocab_size, seed=4)
    assert state_sha256(model.state_dict()) == state_sha256(again.state_dict())
    assert state_sha256(model.state_dict()) != state_sha256(other.state_dict())

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, TOKENIZER.vocab_size, (3, 20), generator=gen)
    with torch.inference_mode():
        logits = model(ids)
        assert logits.shape == (3, 20, TOKENIZER.vocab_size)
        assert torch.equal(logits, again(ids))
        # Causality: changing a later token leaves earlier logits alone.
        changed = ids.clone()
        changed[:, 10] = 3
        assert torch.allclose(model(changed)[:, :10], logits[:, :10])
        # Cached decode (prefill, then one token at a time) matches the full forward.
        cache = model.new_cache(3, torch.device("cpu"))
        steps = [model.forward_cached(ids[:, :12], torch.zeros(3, dtype=torch.long), cache)]
        for t in range(12, 20):
            steps.append(model.forward_cached(ids[:, t : t + 1], torch.full((3,), t), cache))
        assert torch.allclose(torch.cat(steps, dim=1), logits, atol=1e-5)

        logp = token_logprobs(model, ids)
        assert logp.shape == (3, 19)
        expected = torch.log_softmax(logits[0, 4], -1)[ids[0, 5]]
        assert torch.allclose(logp[0, 4], expected)
        assert torch.all(logp <= 0)
    with pytest.raises(ModelError, match="exceeds max_seq_len"):
        model(torch.zeros((1, cfg.max_seq_len + 1), dtype=torch.long))
