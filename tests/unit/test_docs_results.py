"""Every results file the docs cite exists in the repo: a number in README.md or docs/*.md that says where its raw
runs are (`bench/results/stage.json`) must point at a committed file, so the claim can be checked against it.
A number whose file was not kept says so in the doc instead of citing a path."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CITED = re.compile(r"bench/results/[\w.*{}<>\-/]*[\w*}>]")


def cited() -> list[tuple[str, str]]:
    """(file:line, path) for every `bench/results/<something>` path in README.md and docs/*.md."""
    out = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            out += [(f"{path.relative_to(ROOT)}:{n}", m.group(0)) for m in CITED.finditer(line)]
    return out


def _tracked() -> set[str]:
    p = subprocess.run(["git", "ls-files", "bench/results"], cwd=ROOT, capture_output=True, text=True)
    return set(p.stdout.split()) if p.returncode == 0 else set()


def test_every_cited_results_file_exists_and_is_committed():
    found = cited()
    assert found, "no doc cites bench/results/... : the extractor is broken"
    tracked = _tracked()
    missing = [f"{where}: {path}" for where, path in found if not any((ROOT).glob(path))]
    assert not missing, "cited results files that are not in the repo:\n" + "\n".join(missing)
    if tracked:  # in a git checkout: the file must be committed, not only lie here (bench/ writes untracked files)
        untracked = [f"{where}: {path}" for where, path in found
                     if not any(str(p.relative_to(ROOT)) in tracked for p in ROOT.glob(path))]
        assert not untracked, "cited results files that are not committed (git add them):\n" + "\n".join(untracked)


def test_results_are_not_ignored():
    """bench/results/ was once in .gitignore, which is how stage.json and launch.json got lost."""
    p = subprocess.run(["git", "check-ignore", "-q", "bench/results/x.json"], cwd=ROOT)
    assert p.returncode != 0, "bench/results/ is git-ignored: its files cannot be committed with the docs citing them"


def test_extractor_cases():
    assert CITED.findall("raw output: `bench/results/gpu-h100-2026-11-23.txt`. Every") == [
        "bench/results/gpu-h100-2026-11-23.txt"]
    assert CITED.findall("results `bench/results/scale.json`, `scale.png`") == ["bench/results/scale.json"]
    assert CITED.findall("write their raw runs to `bench/results/`.") == []
