"""What the docs say that the code can confirm, read from the pages and compared with the code: the generative
engine's options table (every option, and its default), the routing table, every `python -m ...`, `zserve ...` and
`make ...` command with its flags, every repository path, every `ZSERVE_*` variable, every handler
`package.module:Class`, and the layout in docs/architecture.md naming every module. A page that names something
the code no longer has, or a table that misses what the code added, fails here."""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import re
import typing
from functools import cache
from pathlib import Path

import msgspec
import pytest

from zserve.cli import build_parser
from zserve.config import ModelConfig
from zserve.models.causal_lm import CausalLM

ROOT = Path(__file__).resolve().parents[2]
# the site, and the overview pages at the top of the repository and of bench/
PAGES = [*sorted((ROOT / "docs").glob("*.md")), *sorted(ROOT.glob("*.md")), *sorted((ROOT / "bench").glob("*.md"))]
# Where the code lives, for the checks that look a name up in it.
CODE_ROOMS = ["zserve", "tools", "bench", "tests", ".ci", "deploy"]
# The rooms of docs/architecture.md's layout.
LAYOUT_ROOMS = ["zserve", "tools"]
# What commands write (the paths a page names as their output): not in the repository.
OUTPUTS = ("bench/results/", "deploy/k8s/out")
# Stale flags on a page this test cannot fix, each with its way out; the test fails when one is gone, so that the
# list only shrinks.
KNOWN_STALE_FLAGS: set[tuple[str, str, str]] = set()


def _rel(page: Path) -> str:
    return str(page.relative_to(ROOT))


def _section(page: Path, heading: str) -> str:
    """The text under ``## heading`` up to the next heading of that level or above."""
    text = page.read_text()
    start = text.index(f"\n## {heading}\n")
    end = re.search(r"\n#{1,2} ", text[start + 1 :])
    return text[start : start + 1 + end.start()] if end else text[start:]


def _table_rows(text: str) -> list[list[str]]:
    rows = []
    for line in text.splitlines():
        if line.startswith("|") and not re.match(r"^\|[-| :]+\|$", line):
            rows.append([cell.strip() for cell in line.strip("|").split(" | ")])
    return rows[1:]  # the header row out


def _code_texts(page: Path) -> list[str]:
    """Every piece of code on a page: each line of a fenced block (a trailing backslash joins the next), and each
    inline code span of the prose (which may wrap over a line)."""
    text = page.read_text()
    pieces: list[str] = []
    for block in re.findall(r"^```[^\n]*\n(.*?)^```", text, flags=re.S | re.M):
        pieces += block.replace("\\\n", " ").splitlines()
    prose = re.sub(r"^```[^\n]*\n.*?^```", "", text, flags=re.S | re.M)
    pieces += [" ".join(span.split()) for span in re.findall(r"`([^`]+)`", prose)]
    return pieces


def _commands(program: str) -> list[tuple[str, str, list[str]]]:
    """(page, the word after ``program``, its --flags) for each command of ``program`` on any page."""
    found = []
    pattern = re.compile(rf"(?:^|&&|;|\$|\()\s*(?:[A-Z_]+=\S+\s+)*{program}\s+([^\s`|;&>#]+)([^`|;&>#]*)")
    for page in PAGES:
        for piece in _code_texts(page):
            for word, rest in pattern.findall(piece):
                flags = re.findall(r"(?<![\w-])--[a-z][\w-]*", rest)  # also inside [--port P]
                found.append((_rel(page), word, flags))
    return found


# ---- the generative engine's options ----


def _engine_option_rows() -> dict[str, str]:
    rows = _table_rows(_section(ROOT / "docs" / "generation.md", "Engine options"))
    return {row[0].strip("`"): row[2] for row in rows}


def test_the_engine_options_table_names_every_option_of_causal_lm_with_its_default() -> None:
    """The table is generated (tests/docs/test_config_reference.py keeps it current); here: what it says is what
    CausalLM takes, each option with its default."""
    table = _engine_option_rows()
    defaults = {**msgspec.structs.asdict(CausalLM(path="x").engine_options), "path": ""}  # path: required
    assert list(table) == list(defaults)
    wrong = {
        name: (cell, defaults[name]) for name, cell in table.items() if json.loads(cell.strip("`")) != defaults[name]
    }
    assert not wrong, f"documented default against the code's: {wrong}"


def test_the_one_required_engine_option_is_refused_when_missing() -> None:
    with pytest.raises(ValueError, match="`path`"):
        CausalLM()
    with pytest.raises(ValueError, match="unknown CausalLM option `colour`"):
        CausalLM(path="x", colour="blue")


def test_the_routing_table_names_every_routing_value() -> None:
    rows = _table_rows(_section(ROOT / "docs" / "generation.md", "Routing across engines"))
    documented = {re.match(r'`"(\w+)"`', row[0]).group(1) for row in rows if row[0].startswith('`"')}
    values = set(typing.get_args(typing.get_type_hints(ModelConfig)["routing"]))
    assert documented == values


# ---- commands ----


def _files_of(module: str) -> list[Path]:
    try:
        spec = importlib.util.find_spec(module)
    except ModuleNotFoundError:  # a name imported from a module, not a module
        return []
    if spec is None or not spec.origin:
        return []
    origin = Path(spec.origin)
    return sorted(origin.parent.rglob("*.py")) if origin.name in ("__init__.py", "__main__.py") else [origin]


@cache
def _module_sources(module: str) -> str:
    """The source of ``module`` (a package: every file under it) and of the bench modules it imports (a shared
    ``--isa``), where its flags are declared."""
    files = _files_of(module)
    for path in list(files):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("bench"):
                for alias in node.names:
                    files += _files_of(f"{node.module}.{alias.name}") or _files_of(node.module)
    return "\n".join(path.read_text() for path in dict.fromkeys(files))


def _declared(flag: str, source: str) -> bool:
    """``flag`` is named in ``source``; ``--no-X`` also where ``--X`` is a BooleanOptionalAction (both exist)."""
    if f'"{flag}"' in source:
        return True
    return flag.startswith("--no-") and f'"--{flag[5:]}"' in source and "BooleanOptionalAction" in source


def test_every_python_m_command_names_a_module_with_those_flags() -> None:
    missing, unknown_flags = [], []
    for page, module, flags in _commands(r"python(?:3)? -m"):
        module = module.rstrip(".,:")
        if any(part[:1].isupper() for part in module.split(".")):
            continue  # a placeholder: bench.SUITE, bench.studies.NAME
        if importlib.util.find_spec(module.split(".")[0]) is None:
            continue  # another project's module (pip, venv, mkdocs are not ours to check)
        if not module.startswith(("zserve", "bench")):
            continue
        if importlib.util.find_spec(module) is None:
            missing.append((page, module))
            continue
        source = _module_sources(module)
        unknown_flags += [(page, module, flag) for flag in flags if not _declared(flag, source)]
    assert not missing, f"`python -m` of modules that do not exist: {missing}"
    assert KNOWN_STALE_FLAGS <= set(unknown_flags), f"fixed, take off KNOWN_STALE_FLAGS: {KNOWN_STALE_FLAGS}"
    unknown_flags = [flag for flag in unknown_flags if flag not in KNOWN_STALE_FLAGS]
    assert not unknown_flags, f"flags no argument parser of the module declares: {unknown_flags}"


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def _flags(parser: argparse.ArgumentParser) -> set[str]:
    flags = {s for a in parser._actions for s in a.option_strings}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for nested in action.choices.values():
                flags |= _flags(nested)
    return flags


def test_every_zserve_command_names_a_subcommand_with_those_flags() -> None:
    parser = build_parser()
    subcommands = _subcommands(parser)
    # "zserve ready: http://..." is the ready line and "zserve serve's own" prose, not commands
    commands = [(page, word, flags) for page, word, flags in _commands("zserve") if re.match(r"^[a-z][a-z-]*$", word)]
    assert len(commands) > 20  # the reader finds them
    unknown = [(page, word) for page, word, _ in commands if word not in subcommands]
    assert not unknown, f"`zserve` subcommands that do not exist: {unknown}"
    wrong = [
        (page, word, flag) for page, word, flags in commands for flag in flags if flag not in _flags(subcommands[word])
    ]
    wrong += [(page, "", word) for page, word, _ in _commands("zserve") if word.startswith("-")
              and word not in _flags(parser)]  # fmt: skip
    assert not wrong, f"flags the subcommand does not take: {wrong}"


def test_every_make_target_exists() -> None:
    makefile = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([\w-]+):", makefile, flags=re.M))
    named = [(page, word) for page, word, _ in _commands("make") if "=" not in word]
    assert named
    unknown = [(page, word) for page, word in named if word not in targets]
    assert not unknown, f"make targets that do not exist: {unknown}"


# ---- names of things in the repository ----

_PATH = re.compile(r"(?<![\w./~-])((?:zserve|broker|stages|frontends|tests|bench|deploy|docs|\.ci)/[\w./-]*[\w/])")


def test_every_repository_path_a_page_names_exists() -> None:
    missing = []
    for page in PAGES:
        for number, line in enumerate(page.read_text().splitlines(), 1):
            for path in _PATH.findall(line):
                if not path.startswith(OUTPUTS) and not (ROOT / path.split("::")[0]).exists():
                    missing.append(f"{_rel(page)}:{number}: {path}")
    assert not missing, "paths that do not exist:\n" + "\n".join(missing)


@cache
def _code_text() -> str:
    files = [p for room in CODE_ROOMS for p in (ROOT / room).rglob("*") if p.is_file() and p.suffix != ".md"]
    files += [ROOT / "Makefile", ROOT / "supervisor.toml"]
    return "\n".join(p.read_text(errors="replace") for p in files if p.suffix not in (".json", ".png"))


def test_every_zserve_environment_variable_a_page_names_is_read_by_the_code() -> None:
    named = {(name, _rel(page)) for page in PAGES for name in re.findall(r"\bZSERVE_[A-Z0-9_]*[A-Z0-9]\b",
                                                                           page.read_text())}  # fmt: skip
    unknown = sorted((page, name) for name, page in named if name not in _code_text())
    assert not unknown, f"ZSERVE_ variables the code does not know: {unknown}"


def test_every_handler_a_page_names_is_defined() -> None:
    handlers = {
        (m.group(1), m.group(2), _rel(page))
        for page in PAGES
        for m in re.finditer(r"\b(zserve\.[\w.]+):([A-Z]\w*)", page.read_text())
    }
    assert handlers
    missing = []
    for module, name, page in sorted(handlers):
        spec = importlib.util.find_spec(module)
        tree = ast.parse(Path(spec.origin).read_text()) if spec and spec.origin else None
        defined = tree is not None and any(
            isinstance(node, ast.ClassDef | ast.FunctionDef) and node.name == name for node in tree.body
        )
        if not defined:
            missing.append((page, f"{module}:{name}"))
    assert not missing, f"handlers that do not exist: {missing}"


def test_the_layout_in_architecture_names_every_module() -> None:
    layout = _section(ROOT / "docs" / "architecture.md", "8. Layout")
    modules = sorted(
        str(path.relative_to(ROOT))
        for room in LAYOUT_ROOMS
        for path in (ROOT / room).rglob("*.py")
        if path.name != "__init__.py"
    )
    unnamed = [module for module in modules if not re.search(rf"(?<![\w]){re.escape(Path(module).name)}", layout)]
    assert not unnamed, f"modules docs/architecture.md's layout does not name: {unnamed}"
    named = set(re.findall(r"(?<![\w/.])(\w+\.py)\b", layout))
    gone = sorted(named - {Path(m).name for m in modules} - {"__init__.py"})
    assert not gone, f"modules docs/architecture.md's layout names that do not exist: {gone}"


def test_every_metric_a_page_names_is_exported() -> None:
    """Prometheus names (``zserve_requests_total``, ``zserve_kv_cache_usage``, ...): each is written by the code,
    without the suffixes prometheus-client adds (``_total``, ``_bucket``, ``_count``, ``_sum``, ``_created``)."""
    named = {(name, _rel(page)) for page in PAGES for name in re.findall(r"\bzserve_[a-z0-9_]*[a-z0-9]\b",
                                                                           page.read_text())}  # fmt: skip
    assert len(named) > 20
    unknown = sorted(
        (page, name)
        for name, page in named
        if not re.search(rf"\b{re.sub(r'_(total|bucket|count|sum|created)$', '', name)}\b", _code_text())
    )
    assert not unknown, f"metrics the code does not export: {unknown}"


def test_the_nginx_keep_alive_numbers_are_the_frontends() -> None:
    """deploy/nginx.conf's upstream idle timeout stays below the keep-alive the frontends advertise, and what its
    comments say of gunicorn's --keep-alive is what the supervisor passes: keep_alive_s + 1."""
    from zserve.config import FrontendsConfig

    text = (ROOT / "deploy" / "nginx.conf").read_text()
    keep_alive_s = FrontendsConfig().keep_alive_s
    [timeout] = re.findall(r"^\s*keepalive_timeout (\d+)s;", text, re.M)
    assert int(timeout) < keep_alive_s
    claims = [int(n) for n in re.findall(r"--keep-alive\W*(\d+)", text)]
    assert claims and all(n == keep_alive_s + 1 for n in claims), claims


def test_the_kubernetes_example_is_the_repository_config_rendered_today(tmp_path: Path) -> None:
    """deploy/k8s/example/ is what deploy/k8s/README.md's command renders from supervisor.toml now: a config option
    added or a module moved (the engines' `python -m` path) shows up here rather than in a user's cluster."""
    from zserve.cli import main

    out = tmp_path / "example"
    assert (
        main(["k8s", "-c", str(ROOT / "supervisor.toml"), "-o", str(out), "--image", "registry.example.com/zserve:cpu"])
        == 0
    )
    example = ROOT / "deploy" / "k8s" / "example"
    rendered = {p.name: p.read_text() for p in sorted(out.iterdir())}
    kept = {p.name: p.read_text() for p in sorted(example.glob("*.yaml"))}
    assert sorted(kept) == sorted(rendered), "regenerate deploy/k8s/example with the command in deploy/k8s/README.md"
    stale = [name for name in rendered if rendered[name] != kept[name]]
    assert not stale, f"{stale} differ: regenerate deploy/k8s/example with the command in deploy/k8s/README.md"
