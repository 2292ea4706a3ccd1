"""Every Python code block of every README and docs page runs as written.

Collected from every ``README.md`` of the repository and every page under
``docs/`` (``.md`` fenced blocks; ``.rst`` ``code-block`` directives). Each
Python block runs alone, as a reader would paste it into a file: in a fresh
interpreter, in an empty folder. How a block runs is said by a marker on the
line right before it (an HTML comment in Markdown, a comment in rST):

* no marker: ``python example.py`` on the CPU (``nox -s tests``);
* ``<!-- example: gpu -->`` / ``.. example: gpu``: the same on a GPU, run by
  ``nox -s tests-gpu`` (marked ``gpu``);
* ``<!-- example: torchrun --standalone --nproc-per-node 2 shard.py -->``:
  the block is saved as the ``.py`` file the command names and the command
  runs exactly as written; the page must show the same command in a shell
  block, so the reader sees how to launch it. ``gpu; <command>`` runs it on
  GPUs.

A Python block whose marker is not one of these, a code block without a
language or with one this file does not know, and a ``pycon`` block fail
the collection test: no block is left out silently.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
import torch

from groupgrad_testsupport.readme_blocks import (
    PYTHON,
    ROOT,
    Block,
    pages,
    parse,
    processes,
    run_block,
)

TIMEOUT_S = 600


def _collect() -> tuple[list[Block], list[str]]:
    blocks, problems = [], []
    for path in pages():
        found, wrong = parse(path)
        blocks += found
        problems += wrong
    return blocks, problems


BLOCKS, PROBLEMS = _collect()
PYTHON_BLOCKS = [b for b in BLOCKS if b.language in PYTHON]


def test_every_code_block_is_routed() -> None:
    assert not PROBLEMS, "\n".join(PROBLEMS)
    assert PYTHON_BLOCKS, "no Python block found: the collection is broken"
    # A bare rST `::` block is not collected: the docs must render it as text, not Python.
    assert re.search(r'^highlight_language = "none"', (ROOT / "docs" / "conf.py").read_text(), re.M)


def test_every_package_readme_and_docs_page_is_read() -> None:
    read = {block.path for block in BLOCKS} | set(pages())
    folders = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["groupgrad"]["packages"]
    for readme in [ROOT / "README.md", *(ROOT / f / "README.md" for f in folders)]:
        assert readme in read, readme
    assert (ROOT / "docs" / "quickstart.rst") in read
    assert (ROOT / "docs" / "install.rst") in read


def _parameters() -> list[object]:
    params = []
    for block in PYTHON_BLOCKS:
        marks = [pytest.mark.gpu] if block.gpu else []
        params.append(pytest.param(block, id=block.id, marks=marks))
    return params


@pytest.mark.parametrize("block", _parameters())
def test_block_runs_as_written(block: Block, tmp_path: Path) -> None:
    if block.gpu and not torch.cuda.is_available():
        pytest.skip("a GPU example: needs a CUDA device (nox -s tests-gpu)")
    if block.gpu and processes(block) > torch.cuda.device_count():
        pytest.skip(
            f"a {processes(block)}-process GPU example: needs {processes(block)} CUDA devices, "
            f"found {torch.cuda.device_count()}"
        )
    done = run_block(block, tmp_path, TIMEOUT_S)
    assert done.returncode == 0, (
        f"{block.id} ({' '.join(done.args)}) exited {done.returncode}:\n"
        f"--- stdout ---\n{done.stdout[-3000:]}\n--- stderr ---\n{done.stderr[-6000:]}"
    )
