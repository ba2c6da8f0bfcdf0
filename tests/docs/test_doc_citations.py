"""Code comments cite documentation by path (`docs/<page>.md`): every page cited must exist, and no comment cites
the README, which is an overview, not a reference."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ROOMS = ["zserve", "tools", "tests", "bench", "deploy"]
SUFFIXES = {".py", ".sh", ".toml", ".c", ".yaml", ".yml", ".conf"}
DOCS_PAGE = re.compile(r"docs/([\w./-]+\.md)")
# "README" as a citation, not a path to some folder's own README (bench/README.md, bench/gpu/README.md, ...).
ROOT_README = re.compile(r"(?<![\w/])README(?!\.md)|(?<![\w/])README\.md")


def source_files() -> list[Path]:
    found = sorted(p for room in ROOMS for p in (ROOT / room).rglob("*") if p.is_file() and p.suffix in SUFFIXES)
    return [*found, ROOT / "supervisor.toml", ROOT / "Makefile"]


def test_every_cited_docs_page_exists() -> None:
    missing = [
        f"{path.relative_to(ROOT)}:{number}: docs/{page}"
        for path in source_files()
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
        for page in DOCS_PAGE.findall(line)
        if not (ROOT / "docs" / page).is_file()
    ]
    assert not missing, "cited docs pages that do not exist:\n" + "\n".join(missing)


def test_no_comment_cites_the_readme() -> None:
    this = Path(__file__).resolve()
    cites = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for path in source_files()
        if path.resolve() != this
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
        if ROOT_README.search(line)
    ]
    assert not cites, "cite a docs/ page instead of the README:\n" + "\n".join(cites)
