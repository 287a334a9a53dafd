"""How the files of a trainer checkpoint are encoded, so that nothing read can run code.

Why: model and optimizer load with ``torch.load(weights_only=True)``, the RNG state is JSON
(bit-exact: integers, base64 bytes, floats by repr), and the store checks every file against
the marker's sha256 before it is decoded here. Format 1 entries (the RNG state pickled with
numpy arrays in ``rng.pt``) are still read, with a restricted unpickler allowing only
numpy's array reconstruction.
"""

from __future__ import annotations

import base64
import importlib
import io
import json
import logging
import random
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from rolloutrun_runtime.algorithms.trainer_checkpoint.errors import TrainerCheckpointError

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------- torch files
def torch_bytes(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def torch_load(data: bytes, what: str) -> Any:
    try:
        # weights_only: tensors and plain containers only; a file that asks for anything
        # else (a pickled callable, an arbitrary class) is refused before it is built.
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as error:
        raise TrainerCheckpointError(f"cannot read {what}: {error}") from error


# --------------------------------------------------------------------------- RNG state
def capture_rng() -> dict[str, Any]:
    """The process's RNG states (torch CPU, CUDA when in use, numpy global, Python)."""
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": np.random.get_state(),
        "python": random.getstate(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: Mapping[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if state.get("cuda"):
        if torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda"])
        else:
            logger.warning("the checkpoint holds CUDA RNG states but CUDA is not available")


def _b64(tensor: torch.Tensor) -> str:
    return base64.b64encode(tensor.to("cpu").contiguous().numpy().tobytes()).decode("ascii")


def _unb64(text: Any, what: str) -> torch.Tensor:
    if not isinstance(text, str):
        raise TrainerCheckpointError(f"{what} is not a base64 string")
    try:
        raw = base64.b64decode(text, validate=True)
    except ValueError as error:
        raise TrainerCheckpointError(f"{what} is not valid base64 ({error})") from error
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).clone()


def encode_rng(state: Mapping[str, Any]) -> bytes:
    """The RNG states as JSON (bit-exact: integers, base64 bytes, floats by repr)."""
    kind, keys, pos, has_gauss, cached = state["numpy"]
    version, internal, gauss_next = state["python"]
    data: dict[str, Any] = {
        "torch": _b64(state["torch"]),
        "numpy": {
            "kind": str(kind),
            "keys": [int(key) for key in keys],
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "python": {"version": version, "internal": list(internal), "gauss_next": gauss_next},
    }
    if state.get("cuda"):
        data["cuda"] = [_b64(device_state) for device_state in state["cuda"]]
    return json.dumps(data, sort_keys=True).encode()


def _is_int_list(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(item, int) and not isinstance(item, bool) for item in value
    )


def decode_rng(raw: bytes, source: str) -> dict[str, Any]:
    """The states :func:`restore_rng` takes, from :func:`encode_rng`'s JSON (checked)."""
    try:
        data = json.loads(raw.decode("utf-8"))
        numpy_state, python_state = data["numpy"], data["python"]
        keys, internal = numpy_state["keys"], python_state["internal"]
        gauss_next = python_state["gauss_next"]
        well_formed = (
            isinstance(numpy_state["kind"], str)
            and _is_int_list(keys)
            and all(0 <= key < 2**32 for key in keys)
            and _is_int_list(internal)
            and isinstance(python_state["version"], int)
            and (gauss_next is None or isinstance(gauss_next, float))
            and isinstance(numpy_state["cached_gaussian"], float)
            and isinstance(data.get("cuda", []), list)
        )
        if not well_formed:
            raise TypeError("unexpected field types")
        state: dict[str, Any] = {
            "torch": _unb64(data["torch"], f"{source}: torch"),
            "numpy": (
                numpy_state["kind"],
                np.array(keys, dtype=np.uint32),
                int(numpy_state["pos"]),
                int(numpy_state["has_gauss"]),
                numpy_state["cached_gaussian"],
            ),
            "python": (python_state["version"], tuple(internal), gauss_next),
        }
    except (UnicodeDecodeError, ValueError, KeyError, TypeError) as error:
        raise TrainerCheckpointError(f"cannot read {source}: not an RNG state ({error})") from error
    if data.get("cuda"):
        state["cuda"] = [_unb64(text, f"{source}: cuda") for text in data["cuda"]]
    return state


def legacy_rng(data: bytes, source: str) -> dict[str, Any]:
    """A format 1 ``rng.pt``: the restricted unpickler, allowing numpy's array rebuild only."""
    try:
        multiarray = importlib.import_module("numpy._core.multiarray")
    except ImportError:  # numpy 1
        multiarray = importlib.import_module("numpy.core.multiarray")
    _reconstruct = multiarray._reconstruct

    allowed: list[Any] = [
        np.ndarray,
        np.dtype,
        type(np.dtype(np.uint32)),
        _reconstruct,
        (_reconstruct, "numpy.core.multiarray._reconstruct"),  # written by numpy 1
    ]
    with torch.serialization.safe_globals(allowed):
        state = torch_load(data, source)
    try:
        kind, keys, pos, has_gauss, cached = state["numpy"]
        version, internal, gauss_next = state["python"]
        if not (
            isinstance(state["torch"], torch.Tensor)
            and isinstance(keys, np.ndarray)
            and keys.dtype == np.uint32
        ):
            raise TypeError("unexpected field types")
        return {
            "torch": state["torch"],
            "numpy": (str(kind), keys, int(pos), int(has_gauss), float(cached)),
            "python": (int(version), tuple(int(x) for x in internal), gauss_next),
        }
    except (KeyError, TypeError, ValueError) as error:
        raise TrainerCheckpointError(f"cannot read {source}: not an RNG state ({error})") from error
