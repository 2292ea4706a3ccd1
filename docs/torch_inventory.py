"""Write a Sphinx inventory of the PyTorch names groupgrad's docs link to.

The docs build must work without network access, so instead of downloading
PyTorch's ``objects.inv`` we write the few entries we reference; intersphinx
then links them to PyTorch's online documentation.
"""

from __future__ import annotations

import zlib
from pathlib import Path

# (role, name, page#anchor relative to https://docs.pytorch.org/docs/stable/)
_ENTRIES = [
    ("py:class", "torch.Tensor", "tensors.html#torch.Tensor"),
    ("py:class", "torch.dtype", "tensor_attributes.html#torch.dtype"),
    ("py:class", "torch.device", "tensor_attributes.html#torch.device"),
    ("py:class", "torch.nn.Module", "generated/torch.nn.Module.html#torch.nn.Module"),
    (
        "py:class",
        "torch.nn.Parameter",
        "generated/torch.nn.parameter.Parameter.html#torch.nn.parameter.Parameter",
    ),
    (
        "py:class",
        "torch.nn.parameter.Parameter",
        "generated/torch.nn.parameter.Parameter.html#torch.nn.parameter.Parameter",
    ),
    ("py:class", "torch.autograd.Function", "autograd.html#torch.autograd.Function"),
    ("py:class", "torch.Generator", "generated/torch.Generator.html#torch.Generator"),
    ("py:data", "torch.float32", "tensor_attributes.html#torch.dtype"),
    ("py:data", "torch.bfloat16", "tensor_attributes.html#torch.dtype"),
    ("py:data", "torch.float16", "tensor_attributes.html#torch.dtype"),
    ("py:function", "torch.compile", "generated/torch.compile.html#torch.compile"),
    ("py:function", "torch.library.custom_op", "library.html#torch.library.custom_op"),
    ("py:function", "torch.library.opcheck", "library.html#torch.library.opcheck"),
    ("py:function", "torch._grouped_mm", "generated/torch._grouped_mm.html"),
    (
        "py:class",
        "torch.distributed.ProcessGroup",
        "distributed.html#torch.distributed.ProcessGroup",
    ),
    ("py:module", "torch.distributed", "distributed.html#module-torch.distributed"),
]


def write_torch_inventory(path: Path) -> Path:
    """Write the inventory to ``path`` (version 2 format) and return ``path``."""
    header = (
        "# Sphinx inventory version 2\n"
        "# Project: PyTorch\n"
        "# Version: stable\n"
        "# The remainder of this file is compressed using zlib.\n"
    )
    body = "".join(f"{name} {role} 1 {uri} -\n" for role, name, uri in _ENTRIES)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(header.encode() + zlib.compress(body.encode()))
    return path
