"""The user documentation holds together: README.md, docs/**/*.md and the package's own pages (megatron_zpp/**/*.md,
which the README links for design notes) link only to files that exist, the README stays a short first page, every
`make <target>` the pages tell a user to run is a Makefile rule, and CI runs the README's test command.

Pure file reads, no processes: well under a second."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 200

# [text](target) and ![alt](target); a target ends at whitespace or ")", an optional "title" after it.
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
# Fenced code blocks and inline code spans: where commands are written.
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
CODE_SPAN = re.compile(r"`([^`\n]+)`")
MAKE_CALL = re.compile(r"(?:^|[\s;&|(])make((?:\s+[^\s;&|)`#]+)*)")
MAKEFILE_RULE = re.compile(r"^([A-Za-z0-9_.\-]+(?:[ \t]+[A-Za-z0-9_.\-]+)*)[ \t]*:(?![=:])", re.M)


def doc_pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), *sorted((ROOT / "megatron_zpp").rglob("*.md"))]


def relative_links(page: Path) -> list[str]:
    """Link targets of `page` that point into the repository: no URL scheme, not a bare anchor."""
    text = FENCE.sub("", page.read_text(encoding="utf-8"))
    targets = (match.group(1) for match in LINK.finditer(text))
    return [t for t in targets if not re.match(r"^[a-zA-Z][a-zA-Z0-9+.\-]*:", t) and not t.startswith("#")]


def make_targets_mentioned(text: str) -> set[str]:
    """The target of every `make ...` written as a command (in a fenced block or a code span): the first word
    after `make` that is neither an option nor a VAR=value assignment."""
    commands = FENCE.findall(text)
    commands += CODE_SPAN.findall(FENCE.sub("", text))
    targets = set()
    for command in commands:
        for line in command.splitlines():
            line = line.split("#", 1)[0]
            for call in MAKE_CALL.finditer(line):
                words = call.group(1).split()
                names = [w for w in words if not w.startswith("-") and "=" not in w and not w.startswith(("'", '"'))]
                if names and re.fullmatch(r"[A-Za-z0-9_.\-]+", names[0]):
                    targets.add(names[0])
    return targets


def makefile_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text(encoding="utf-8")
    targets = set()
    for match in MAKEFILE_RULE.finditer(text):
        targets.update(match.group(1).split())
    return {t for t in targets if not t.startswith(".") and "$" not in t}


@pytest.mark.parametrize("page", doc_pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_point_to_existing_files(page: Path):
    missing = []
    for target in relative_links(page):
        path = target.split("#", 1)[0].split("?", 1)[0]
        if path and not (page.parent / path).exists():
            missing.append(target)
    assert not missing, f"{page.relative_to(ROOT)} links to missing files: {missing}"


def test_readme_is_a_short_first_page():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines < README_MAX_LINES, (
        f"README.md has {lines} lines; keep it under {README_MAX_LINES} (move detail to docs/)")


def test_every_make_target_in_the_docs_exists():
    known = makefile_targets()
    assert {"train", "test"} <= known, f"the Makefile's targets as parsed: {sorted(known)}"
    unknown = {}
    for page in doc_pages():
        for target in make_targets_mentioned(page.read_text(encoding="utf-8")) - known:
            unknown.setdefault(target, []).append(str(page.relative_to(ROOT)))
    assert not unknown, (
        f"`make <target>` in the docs without a Makefile rule: {unknown}; targets: {sorted(known)}")


def test_the_checks_can_fail():
    """The parsers find what they must: a broken link, a made-up target, and no false hit in prose."""
    sample = "see [x](nowhere/missing.md) and [site](https://example.org) [here](#anchor)\n"
    sample += "```bash\nmake nosuch ARGS=1\n```\n"
    sample += "We make sure that `sudo make sweep` and `make PYTHON=python3.11` and `make test-gpu-kit` parse.\n"
    assert LINK.findall(sample) == ["nowhere/missing.md", "https://example.org", "#anchor"]
    assert make_targets_mentioned(sample) == {"nosuch", "sweep", "test-gpu-kit"}
    assert "nosuch" not in makefile_targets()


def test_ci_runs_the_readme_test_command():
    """The README tells users `make test` is what CI runs; .ci/run must run exactly that first."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    two_commands = FENCE.search(readme.split("## Two commands", 1)[1]).group(0)
    assert {"train", "test"} <= make_targets_mentioned(two_commands)
    ci_commands = [line.strip() for line in (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
                   if line.strip().startswith("make ")]
    assert ci_commands and ci_commands[0] == "make test", f".ci/run's make commands: {ci_commands}"
