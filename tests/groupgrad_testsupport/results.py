"""Rank results as JSON: how what a worker returns reaches the test.

:func:`encode` turns a result into JSON-able values, :func:`decode` undoes it,
exactly (tensors to the bit, tuples stay tuples):

====================  ========================================================
Python value          JSON
====================  ========================================================
``None``, ``bool``,   themselves (``float`` NaN and infinities as Python's
``int``, ``float``,   ``NaN`` / ``Infinity`` JSON extension)
``str``, ``list``
``dict``              an object; keys must be ``str``
``tuple``,            ``{"__tuple__": [...]}``
``torch.Size``
``torch.dtype``       ``{"__dtype__": "bfloat16"}``
``torch.Tensor``      ``{"__tensor__": {"dtype": "bfloat16", "shape": [2, 3],
                      "data": BASE64}}``: the detached values, moved to the
                      CPU, row-major, as raw bytes in the machine's byte order
                      (little-endian on every platform PyTorch supports),
                      base64-encoded. Decoded as a contiguous CPU tensor that
                      does not require grad.
====================  ========================================================

Anything else (a module, a dataclass, a ``dict`` with non-``str`` keys) is a
``TypeError`` that names where in the result it sits: return plain data.
"""

from __future__ import annotations

import base64
import ctypes
import json
import os
from pathlib import Path
from typing import Any

import torch

_TENSOR, _TUPLE, _DTYPE = "__tensor__", "__tuple__", "__dtype__"


def _tensor_bytes(tensor: torch.Tensor) -> bytes:
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    if flat.numel() == 0:
        return b""
    raw = flat.view(torch.uint8)
    return ctypes.string_at(raw.data_ptr(), raw.numel())


def encode(value: Any, where: str = "result") -> Any:
    """``value`` as JSON-able data (see the module docstring); ``where`` names it in errors."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, torch.Tensor):
        data = base64.b64encode(_tensor_bytes(value)).decode("ascii")
        dtype = str(value.dtype).removeprefix("torch.")
        return {_TENSOR: {"dtype": dtype, "shape": list(value.shape), "data": data}}
    if isinstance(value, torch.dtype):
        return {_DTYPE: str(value).removeprefix("torch.")}
    if isinstance(value, tuple):
        return {_TUPLE: [encode(v, f"{where}[{i}]") for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [encode(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        bad = [k for k in value if not isinstance(k, str)]
        if bad:
            raise TypeError(f"{where} has non-str keys {bad[:3]}; JSON objects need str keys")
        if any(k in (_TENSOR, _TUPLE, _DTYPE) for k in value):
            raise TypeError(f"{where} uses a key reserved for the encoding: {sorted(value)}")
        return {k: encode(v, f"{where}[{k!r}]") for k, v in value.items()}
    raise TypeError(
        f"{where} is a {type(value).__name__}, which a rank result cannot hold; return "
        "None, bool, int, float, str, list, tuple, dict (str keys), torch.dtype or torch.Tensor"
    )


def _decode_object(obj: dict[str, Any]) -> Any:
    if len(obj) == 1:
        if _TUPLE in obj:
            return tuple(obj[_TUPLE])
        if _DTYPE in obj:
            return getattr(torch, obj[_DTYPE])
        if _TENSOR in obj:
            spec = obj[_TENSOR]
            dtype = getattr(torch, spec["dtype"])
            raw = base64.b64decode(spec["data"])
            if not raw:
                return torch.empty(spec["shape"], dtype=dtype)
            flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
            return flat.view(dtype).reshape(spec["shape"])
    return obj


def decode(data: Any) -> Any:
    """Undo :func:`encode` on already-parsed JSON data."""
    if isinstance(data, list):
        return [decode(v) for v in data]
    if isinstance(data, dict):
        return _decode_object({k: decode(v) for k, v in data.items()})
    return data


def dump(value: Any, path: Path) -> None:
    """Write ``value`` encoded to ``path``, atomically (a reader never sees half a file)."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(encode(value)))
    os.replace(partial, path)


def load(path: Path) -> Any:
    """Read what :func:`dump` wrote."""
    return json.loads(path.read_text(), object_hook=_decode_object)
