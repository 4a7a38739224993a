"""The documentation: the site builds with no warning (every link and anchor checked), and the
README stays a user's page whose two set-up commands CI can find."""
from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README_MAX_LINES = 250


def test_the_docs_site_builds_strict_without_a_warning(tmp_path):
    if not (importlib.util.find_spec("mkdocs") and importlib.util.find_spec("material")):
        pytest.fail("mkdocs / mkdocs-material are missing: install the test extra (pip install -e '.[test]')")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # the theme's banner about MkDocs 2.0
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    log = proc.stdout + proc.stderr
    warnings = [line for line in log.splitlines() if "WARNING" in line or "ERROR" in line]
    assert proc.returncode == 0 and not warnings, log
    # the hook published the repository files the pages link to, and they are reachable
    assert (tmp_path / "site" / "repo" / "QUALITY" / "index.html").is_file(), log
    assert (tmp_path / "site" / "repo" / "BENCHMARKS" / "index.html").is_file(), log


def test_the_readme_is_a_short_users_page():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; move detail to docs/"


def test_every_relative_link_of_the_readme_exists():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    missing = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"^[a-z]+:", target) or target.startswith("#"):
            continue
        if not (ROOT / target.split("#")[0]).exists():
            missing.append(target)
    assert not missing, f"README.md links to files that do not exist: {missing}"


@pytest.mark.parametrize("sentence", ["Run the main job", "Run the tests"])
def test_ci_reads_both_commands_from_the_readme(sentence):
    """.ci/run's own readme_command, as CI calls it."""
    script = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    function = re.search(r"^readme_command\(\) \{.*?^\}", script, re.S | re.M).group(0)
    proc = subprocess.run(["bash", "-c", f'{function}\nreadme_command "$1"', "bash", sentence],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    command = proc.stdout.strip()
    assert command and "\n" not in command, proc.stdout
    expected = {"Run the main job": "lazy-rag query", "Run the tests": "pytest"}[sentence]
    assert expected in command and command.startswith("bash install.sh"), command
