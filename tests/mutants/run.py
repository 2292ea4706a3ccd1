"""Apply each deliberate break of ``catalog.py`` to a copy of the tree and run the tests on it.

Usage (what ``nox -s mutants`` runs, in an environment with the project's
dependencies but not the project itself)::

    python tests/mutants/run.py [--only NAME ...] [--maxfail N]

For every mutant: copy the tracked files to a scratch folder, replace the
mutant's snippet (it must occur exactly once), then run the mutant's tests on
the copy, importing the copy's packages (``PYTHONPATH`` lists every ``src/``
folder of the copy). A mutant is *caught* when tests fail while collection
succeeded (a mutant that breaks imports proves nothing); the tests that
failed are printed. The run fails when any mutant survives, breaks
collection, or no longer applies.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from catalog import MUTANTS, Mutant

ROOT = Path(__file__).resolve().parents[2]
FAILED = re.compile(r"^FAILED (\S+)", re.MULTILINE)


def _tracked_files() -> list[str]:
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    return [line for line in listed.stdout.splitlines() if (ROOT / line).is_file()]


def _copy_tree(destination: Path) -> None:
    for relative in _tracked_files():
        target = destination / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / relative, target)


def _apply(copy: Path, mutant: Mutant) -> None:
    path = copy / mutant.path
    text = path.read_text()
    count = text.count(mutant.old)
    if count != 1:
        raise RuntimeError(
            f"mutant {mutant.name!r}: its snippet occurs {count} times in {mutant.path}, "
            "expected exactly once; update tests/mutants/catalog.py"
        )
    path.write_text(text.replace(mutant.old, mutant.new))


def _environment(copy: Path) -> dict[str, str]:
    sources = sorted(str(p) for p in copy.glob("**/src") if (p / "groupgrad").is_dir())
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(sources),
        "CUDA_VISIBLE_DEVICES": "",
        "PYTHONDONTWRITEBYTECODE": "1",
    }


def _imports_the_copy(copy: Path) -> str | None:
    """Why the copy's packages would not be the ones imported, or ``None`` when they are."""
    probe = "import groupgrad.protocol as p, groupgrad.kernels as k, groupgrad.modules as m;"
    probe += "print(p.__file__); print(k.__file__); print(m.__file__)"
    done = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=copy,
        env=_environment(copy),
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        return f"the copy's packages do not import: {done.stderr[-500:]}"
    outside = [line for line in done.stdout.split() if not line.startswith(str(copy))]
    return f"imported from outside the copy: {outside}" if outside else None


def _pytest(copy: Path, args: list[str]) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-m", "not gpu", *args]
    return subprocess.run(
        command, cwd=copy, env=_environment(copy), capture_output=True, text=True, check=False
    )


def _run_one(mutant: Mutant, maxfail: int) -> tuple[str, list[str], float]:
    """``(verdict, failed tests, seconds)``; verdict is caught, SURVIVED, BROKEN or STALE.

    One pytest run: exit code 1 with failed tests is a catch; 0 is a survivor;
    anything else (2: collection errors or an interrupted run, 5: nothing
    collected) means the mutant broke the suite rather than a behaviour.
    """
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="groupgrad-mutant-") as scratch:
        copy = Path(scratch)
        _copy_tree(copy)
        try:
            _apply(copy, mutant)
        except RuntimeError as stale:
            return "STALE", [str(stale)], time.monotonic() - started
        wrong = _imports_the_copy(copy)
        if wrong is not None:
            return "BROKEN", [wrong], time.monotonic() - started
        ran = _pytest(copy, ["-q", "-rf", f"--maxfail={maxfail}", *mutant.tests])
    seconds = time.monotonic() - started
    failed = FAILED.findall(ran.stdout)
    if ran.returncode == 0:
        return "SURVIVED", [], seconds
    if ran.returncode == 1 and failed:
        return "caught", failed, seconds
    tail = (ran.stdout + ran.stderr)[-2000:]
    return (
        "BROKEN",
        [f"pytest exited {ran.returncode} (collection or run broken):\n{tail}"],
        seconds,
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--only", nargs="*", default=None, help="mutant names to run (default: all)"
    )
    parser.add_argument(
        "--maxfail", type=int, default=3, help="stop each mutant's run after N failures (default 3)"
    )
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    options = parser.parse_args()
    names = {m.name for m in MUTANTS}
    unknown = sorted(set(options.only or ()) - names)
    if unknown:
        parser.error(f"--only names unknown mutants {unknown}; known: {sorted(names)}")
    chosen = [m for m in MUTANTS if options.only is None or m.name in options.only]
    if options.list:
        for mutant in chosen:
            print(f"{mutant.name:36} {mutant.what}")
        return 0
    bad = 0
    for index, mutant in enumerate(chosen, 1):
        verdict, failed, seconds = _run_one(mutant, options.maxfail)
        print(f"[{index}/{len(chosen)}] {mutant.name}: {verdict} ({seconds:.0f} s) — {mutant.what}")
        for test in failed:
            print(f"    {test}")
        bad += verdict != "caught"
        sys.stdout.flush()
    print(f"{len(chosen) - bad} of {len(chosen)} mutants caught")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
