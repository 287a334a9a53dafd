"""Write a tiny Hugging Face model: random weights and a tokenizer trained offline.

    python -m rolloutrun_runtime.policy.make_tiny_hf OUT [--family llama|qwen2] [--seed N]

``OUT`` is a directory or a ``file://``/``gs://`` URI (the run's storage, say
``gs://bucket/models/tiny-llama``); ``policy.model`` then names it. Why a script: tests and
``examples/tiny-hf.yaml`` need a model in the Hugging Face layout (``config.json``,
``model.safetensors``, ``tokenizer.json``, ``tokenizer_config.json`` with a chat template)
without any hub or network. The weights come from a small Llama- or Qwen2-style config
(``seed`` fixes them); the tokenizer is a byte-level BPE trained with ``tokenizers`` on the
built-in tasks' text, so the model can learn those tasks in minutes on a CPU.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

from rolloutrun_runtime.policy.hf import offline_transformers
from rolloutrun_runtime.policy.hf_files import TOKENIZER_CONFIG_FILE, TOKENIZER_FILE

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"
VOCAB_SIZE = 320
#: A plain chat template (roles as text), stored as tokenizer_config.json's chat_template.
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"
)
FAMILIES = ("llama", "qwen2")


def task_corpus() -> list[str]:
    """Lines in the built-in tasks' language: sums and reach-target move sequences."""
    lines = [f"{a}+{b}={a + b}" for a in range(20) for b in range(20)]
    for target in range(1, 20):
        for start in range(0, 10):
            step = target - start
            move = f"+{step}" if step >= 0 else str(step)
            lines.append(f"g{target} c{start}>{move} c{target}>")
            lines.append(f"g{target} c{start}>add({step}) c{target}?>")
    return lines


def train_tokenizer(vocab_size: int = VOCAB_SIZE) -> object:
    """A byte-level BPE (GPT-2/Qwen2 style) trained on ``task_corpus``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD, BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(task_corpus(), trainer=trainer)
    return tokenizer


def model_config(family: str, tokenizer: object) -> object:
    """The small config: 2 layers, 64 wide, 4 heads over 2 key/value heads."""
    transformers = offline_transformers()
    ids = {name: tokenizer.token_to_id(name) for name in (PAD, BOS, EOS)}  # type: ignore[attr-defined]
    common = dict(
        vocab_size=tokenizer.get_vocab_size(with_added_tokens=True),  # type: ignore[attr-defined]
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        pad_token_id=ids[PAD],
        bos_token_id=ids[BOS],
        eos_token_id=ids[EOS],
        tie_word_embeddings=False,
        initializer_range=0.02,
    )
    if family == "llama":
        return transformers.LlamaConfig(**common)
    if family == "qwen2":
        return transformers.Qwen2Config(**common)
    raise ValueError(f"unknown family {family!r} (one of {', '.join(FAMILIES)})")


def write_model(out: Path, family: str = "llama", seed: int = 0) -> list[Path]:
    """Write the model directory to ``out``; the same ``(family, seed)`` gives the same files."""
    transformers = offline_transformers()
    tokenizer = train_tokenizer()
    config = model_config(family, tokenizer)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save(str(out / TOKENIZER_FILE))  # type: ignore[attr-defined]
    settings = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "model_max_length": 256,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / TOKENIZER_CONFIG_FILE).write_text(json.dumps(settings, indent=2) + "\n")
    return sorted(p for p in out.iterdir() if p.is_file())


def write_to(uri: str, family: str = "llama", seed: int = 0) -> list[str]:
    """``write_model`` into a directory or a storage URI; returns what was written."""
    if not uri.startswith("gs://"):
        directory = Path(uri[len("file://") :] if uri.startswith("file://") else uri)
        return [str(p) for p in write_model(directory, family, seed)]
    from rolloutrun_runtime.storage import open_storage

    storage = open_storage(uri)
    with tempfile.TemporaryDirectory() as scratch:
        files = write_model(Path(scratch), family, seed)
        storage.upload_files({path.name: path for path in files})
    return [storage.uri_for(path.name) for path in files]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="a directory, file:// or gs:// URI")
    parser.add_argument("--family", choices=FAMILIES, default="llama")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for written in write_to(args.out, args.family, args.seed):
        print(written)
    return 0


if __name__ == "__main__":
    sys.exit(main())
