"""What a Hugging Face model directory (``policy.model``) must hold, and how to tell a
user whose directory does not.

Why in the contract: the trainer and the generation workers load the whole directory, the
Gym only its tokenizer files, and ``rolloutrun run`` (the local cluster, which reaches the
runtime only through the contract) checks a local model before it starts a cluster; all
of them name the same files and give the same one-line error. Standard library only.
"""

from __future__ import annotations

from pathlib import Path

CONFIG_FILE = "config.json"
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
#: The command that writes the examples' model (named when a model directory is missing).
MAKE_TINY_HF = "python -m rolloutrun_runtime.policy.make_tiny_hf"


def model_dir_problem(
    directory: Path, *, tokenizer_only: bool = False, weights: bool = True
) -> str | None:
    """What a model directory lacks, or None when it holds a model (``weights`` False: a
    model whose weights come from elsewhere, so its ``*.safetensors`` are not needed)."""
    if not directory.is_dir():
        return f"{directory} is not a directory"
    needed = [TOKENIZER_FILE] if tokenizer_only else [CONFIG_FILE, TOKENIZER_FILE]
    missing = [name for name in needed if not (directory / name).is_file()]
    if not tokenizer_only and weights and not any(directory.glob("*.safetensors")):
        missing.append("*.safetensors")
    return f"{directory} lacks {', '.join(missing)}" if missing else None


def local_model_problem(uri: str) -> str | None:
    """One line saying why ``policy.model`` (a directory or ``file://``) holds no model, with
    the command that makes the examples' model; None when it does or when it is elsewhere
    (``gs://`` models are checked as they are copied). No copy, no import of ``transformers``:
    meant for the entry points, so a run without its model stops at start."""
    if uri.startswith("file://"):
        directory = Path(uri[len("file://") :])
    elif "://" in uri:
        return None
    else:
        directory = Path(uri)
    problem = model_dir_problem(directory)
    if problem is None:
        return None
    return (
        f"policy.model {uri}: {problem} (a Hugging Face model directory: config.json, "
        f"*.safetensors, tokenizer.json; the examples' model is made by `{MAKE_TINY_HF} "
        f"{directory}`)"
    )
