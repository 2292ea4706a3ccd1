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

import os
import re
import shlex
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
PYTHON = {"python", "py", "python3"}
OTHER = {"bash", "sh", "shell", "console", "text", "toml", "yaml", "json", "cpp", "ini", "none"}
SKIP_DIRS = {".git", ".nox", "dist", "build", "_build", "generated", "_templates", "node_modules"}
TIMEOUT_S = 600


@dataclass(frozen=True)
class Block:
    """One fenced or directive code block of a page."""

    path: Path
    line: int  # 1-based line of the opening fence or directive
    language: str
    code: str
    marker: str | None  # the text after "example:", or None

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"

    @property
    def gpu(self) -> bool:
        return self.marker is not None and self.marker.split(";")[0].strip() == "gpu"

    @property
    def command(self) -> str | None:
        """The launch command of a multi-process block, or ``None`` for ``python example.py``."""
        if self.marker is None:
            return None
        rest = self.marker.split(";", 1)[1] if self.gpu and ";" in self.marker else self.marker
        rest = rest.strip()
        return None if rest in ("", "gpu") else rest


def pages() -> list[Path]:
    """Every README.md of the repository and every docs page (build outputs and venvs skipped)."""
    found = []
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS and not d.startswith("."))
        here = Path(folder)
        in_docs = here.relative_to(ROOT).parts[:1] == ("docs",)
        for name in sorted(files):
            if name == "README.md" or (in_docs and name.endswith((".md", ".rst"))):
                found.append(here / name)
    return found


_FENCE = re.compile(r"^(?P<indent> {0,3})(?P<fence>`{3,}|~{3,})\s*(?P<info>[^`\s]*)")
_MD_MARKER = re.compile(r"^\s*<!--\s*example:\s*(?P<marker>.+?)\s*-->\s*$")
_RST_DIRECTIVE = re.compile(
    r"^(?P<indent>\s*)\.\.\s+(?:code-block|code|sourcecode)::\s*(?P<lang>\S*)"
)
_RST_MARKER = re.compile(r"^\s*\.\.\s+example:\s*(?P<marker>.+?)\s*$")


def _previous_line(lines: list[str], index: int) -> str:
    """The last non-blank line before ``lines[index]``."""
    for line in reversed(lines[:index]):
        if line.strip():
            return line
    return ""


def parse(path: Path) -> tuple[list[Block], list[str]]:
    """The code blocks of a page, and what is wrong with any of them."""
    lines = path.read_text().splitlines()
    blocks, problems = [], []
    where = path.relative_to(ROOT)
    if path.suffix == ".md":
        i = 0
        while i < len(lines):
            opening = _FENCE.match(lines[i])
            if not opening:
                i += 1
                continue
            fence = opening.group("fence")
            end = next(
                (j for j in range(i + 1, len(lines)) if lines[j].strip().startswith(fence)),
                len(lines),
            )
            marker = _MD_MARKER.match(_previous_line(lines, i))
            code = "\n".join(lines[i + 1 : end]) + "\n"
            blocks.append(
                Block(path, i + 1, opening.group("info").lower(), code, marker and marker["marker"])
            )
            i = end + 1
    else:
        for i, line in enumerate(lines):
            directive = _RST_DIRECTIVE.match(line)
            if not directive:
                continue
            indent = len(directive.group("indent"))
            body, j = [], i + 1
            while j < len(lines) and (not lines[j].strip() or _indent(lines[j]) > indent):
                body.append(lines[j])
                j += 1
            content = [b for b in body if not b.strip().startswith(":")] if body else []
            depth = min((_indent(b) for b in content if b.strip()), default=0)
            code = "\n".join(b[depth:] for b in content).strip("\n") + "\n"
            marker = _RST_MARKER.match(_previous_line(lines, i))
            blocks.append(
                Block(
                    path, i + 1, directive.group("lang").lower(), code, marker and marker["marker"]
                )
            )
    for block in blocks:
        at = f"{where}:{block.line}"
        if block.language == "pycon":
            problems.append(f"{at}: a pycon block; write it as a python block that runs")
        elif block.language not in PYTHON | OTHER:
            problems.append(
                f"{at}: code block language {block.language!r}; expected one of "
                f"{sorted(PYTHON | OTHER)} (a block without a language cannot be routed)"
            )
        elif block.marker is not None and block.language not in PYTHON:
            problems.append(f"{at}: an example marker before a {block.language} block")
        elif block.language in PYTHON and block.marker is not None:
            problems.extend(_marker_problems(block, blocks, at))
    return blocks, problems


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _marker_problems(block: Block, blocks: list[Block], at: str) -> list[str]:
    command = block.command
    if block.marker is not None and not block.gpu and command is None:
        return [f"{at}: example marker {block.marker!r}; expected 'gpu' or a launch command"]
    if command is None:
        return []
    words = shlex.split(command)
    if not any(word.endswith(".py") for word in words):
        return [
            f"{at}: example marker {block.marker!r}: expected 'gpu', or a launch command that "
            "names the .py file to save the block as"
        ]
    shown = any(
        command in other.code for other in blocks if other.language in OTHER and other is not block
    )
    if not shown:
        return [f"{at}: the page never shows the launch command {command!r} in a shell block"]
    return []


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
    env = {
        **os.environ,
        # the interpreter's own folder first, so `torchrun` is the one beside it
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
    }
    if not block.gpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    command = block.command
    if command is None:
        script = tmp_path / "example.py"
        argv = [sys.executable, str(script)]
    else:
        argv = shlex.split(command)
        script = tmp_path / next(word for word in argv if word.endswith(".py"))
    script.write_text(block.code)
    done = subprocess.run(
        argv,
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=TIMEOUT_S,
    )
    assert done.returncode == 0, (
        f"{block.id} ({' '.join(argv)}) exited {done.returncode}:\n"
        f"--- stdout ---\n{done.stdout[-3000:]}\n--- stderr ---\n{done.stderr[-6000:]}"
    )
