"""The code blocks of README and docs pages: found, routed, and run as a reader would run them.

Standard library only, so that ``noxfile.py`` can load this file by path and
run a package's README examples in an environment that holds that package
alone (``nox -s tests``' install checks), and ``tests/test_readme_blocks.py``
run every page's examples. How a block runs is said by a marker on the line
right before it (see ``tests/test_readme_blocks.py``).
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PYTHON = {"python", "py", "python3"}
OTHER = {"bash", "sh", "shell", "console", "text", "toml", "yaml", "json", "cpp", "ini", "none"}
SKIP_DIRS = {".git", ".nox", "dist", "build", "_build", "generated", "_templates", "node_modules"}


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


def processes(block: Block) -> int:
    """How many processes the block's launch command starts (1 for ``python example.py``).

    ``--nproc-per-node gpu`` counts as 1 (one per visible GPU, at least one).
    """
    words = shlex.split(block.command or "")
    for flag in ("--nproc-per-node", "--nproc_per_node"):
        if flag in words:
            value = words[words.index(flag) + 1]
            return int(value) if value.isdigit() else 1
    return 1


def run_block(
    block: Block, folder: Path, timeout: float, bin_dir: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """Run a Python block as written: saved into ``folder`` and started as its marker says.

    ``bin_dir`` holds the Python (and ``torchrun``) to run it with, first on
    ``PATH``; default: this interpreter's. On the CPU unless the block is a
    GPU example. The whole process tree is killed on a timeout.
    """
    python = sys.executable if bin_dir is None else str(bin_dir / "python")
    bin_dir = bin_dir or Path(sys.executable).parent
    env = {
        **os.environ,
        "PATH": os.pathsep.join([str(bin_dir), os.environ.get("PATH", "")]),
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
    }
    if not block.gpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    command = block.command
    if command is None:
        script = folder / "example.py"
        argv = [python, str(script)]
    else:
        argv = shlex.split(command)
        script = folder / next(word for word in argv if word.endswith(".py"))
    script.write_text(block.code)
    proc = subprocess.Popen(
        argv, cwd=folder, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # ranks a launcher left behind, too
        proc.wait()
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)
