"""Write the Sphinx inventories of the Python and PyTorch names groupgrad's docs link to.

The docs build must work without network access, so instead of downloading
``objects.inv`` from docs.python.org and docs.pytorch.org we write the entries
we reference; intersphinx then links them to the online documentation. A name
missing here is an unresolved reference, which fails the (nitpicky) build:
add it below.
"""

from __future__ import annotations

import zlib
from pathlib import Path

PYTHON_URL = "https://docs.python.org/3/"
TORCH_URL = "https://docs.pytorch.org/docs/stable/"

# (role, name, page#anchor relative to PYTHON_URL)
PYTHON_ENTRIES = [
    ("py:class", "bool", "library/functions.html#bool"),
    ("py:class", "int", "library/functions.html#int"),
    ("py:class", "float", "library/functions.html#float"),
    ("py:class", "str", "library/stdtypes.html#str"),
    ("py:class", "tuple", "library/stdtypes.html#tuple"),
    ("py:class", "list", "library/stdtypes.html#list"),
    ("py:class", "dict", "library/stdtypes.html#dict"),
    ("py:data", "None", "library/constants.html#None"),
    (
        "py:class",
        "collections.abc.Callable",
        "library/collections.abc.html#collections.abc.Callable",
    ),
    (
        "py:class",
        "collections.abc.Iterable",
        "library/collections.abc.html#collections.abc.Iterable",
    ),
    (
        "py:class",
        "collections.abc.Sequence",
        "library/collections.abc.html#collections.abc.Sequence",
    ),
    (
        "py:class",
        "collections.abc.Mapping",
        "library/collections.abc.html#collections.abc.Mapping",
    ),
    ("py:class", "enum.Enum", "library/enum.html#enum.Enum"),
    ("py:module", "logging", "library/logging.html#module-logging"),
    ("py:class", "os.PathLike", "library/os.html#os.PathLike"),
    ("py:class", "types.ModuleType", "library/types.html#types.ModuleType"),
    ("py:class", "typing.Protocol", "library/typing.html#typing.Protocol"),
    ("py:data", "typing.Any", "library/typing.html#typing.Any"),
    ("py:data", "typing.Literal", "library/typing.html#typing.Literal"),
]

# (role, name, page#anchor relative to TORCH_URL). Classes also under the module
# that defines them (``torch.nn.modules.module.Module``), as autodoc names them.
_MODULE = "generated/torch.nn.Module.html#torch.nn.Module"
_PARAMETER = "generated/torch.nn.parameter.Parameter.html#torch.nn.parameter.Parameter"
_OPTIMIZER = "optim.html#torch.optim.Optimizer"
_PROCESS_GROUP = "distributed.html#torch.distributed.ProcessGroup"
_FULLY_SHARD = "distributed.fsdp.fully_shard.html#torch.distributed.fsdp.fully_shard"
_FSDP_MODULE = "distributed.fsdp.fully_shard.html#torch.distributed.fsdp.FSDPModule"
TORCH_ENTRIES = [
    ("py:class", "torch.Tensor", "tensors.html#torch.Tensor"),
    ("py:class", "torch.dtype", "tensor_attributes.html#torch.dtype"),
    ("py:class", "torch.device", "tensor_attributes.html#torch.device"),
    ("py:class", "torch.nn.Module", _MODULE),
    ("py:class", "torch.nn.modules.module.Module", _MODULE),
    ("py:class", "torch.nn.Parameter", _PARAMETER),
    ("py:class", "torch.nn.parameter.Parameter", _PARAMETER),
    ("py:class", "torch.optim.Optimizer", _OPTIMIZER),
    ("py:class", "torch.optim.optimizer.Optimizer", _OPTIMIZER),
    ("py:class", "torch.autograd.Function", "autograd.html#torch.autograd.Function"),
    ("py:class", "torch.Generator", "generated/torch.Generator.html#torch.Generator"),
    ("py:data", "torch.float32", "tensor_attributes.html#torch.dtype"),
    ("py:data", "torch.bfloat16", "tensor_attributes.html#torch.dtype"),
    ("py:data", "torch.float16", "tensor_attributes.html#torch.dtype"),
    ("py:function", "torch.compile", "generated/torch.compile.html#torch.compile"),
    ("py:function", "torch.library.custom_op", "library.html#torch.library.custom_op"),
    ("py:function", "torch.library.opcheck", "library.html#torch.library.opcheck"),
    ("py:function", "torch._grouped_mm", "generated/torch._grouped_mm.html"),
    ("py:class", "torch.distributed.ProcessGroup", _PROCESS_GROUP),
    ("py:class", "torch.distributed.distributed_c10d.ProcessGroup", _PROCESS_GROUP),
    ("py:module", "torch.distributed", "distributed.html#module-torch.distributed"),
    ("py:function", "torch.distributed.fsdp.fully_shard", _FULLY_SHARD),
    ("py:class", "torch.distributed.fsdp.FSDPModule", _FSDP_MODULE),
]


def write_inventory(path: Path, project: str, entries: list[tuple[str, str, str]]) -> Path:
    """Write ``entries`` to ``path`` as a version-2 Sphinx inventory and return ``path``."""
    header = (
        "# Sphinx inventory version 2\n"
        f"# Project: {project}\n"
        "# Version: stable\n"
        "# The remainder of this file is compressed using zlib.\n"
    )
    body = "".join(f"{name} {role} 1 {uri} -\n" for role, name, uri in entries)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(header.encode() + zlib.compress(body.encode()))
    return path


def intersphinx_mapping(folder: Path) -> dict[str, tuple[str, str]]:
    """Write both inventories under ``folder``; the ``intersphinx_mapping`` that uses them."""
    python = write_inventory(folder / "python-objects.inv", "Python", PYTHON_ENTRIES)
    torch = write_inventory(folder / "torch-objects.inv", "PyTorch", TORCH_ENTRIES)
    return {"python": (PYTHON_URL, str(python)), "torch": (TORCH_URL, str(torch))}
