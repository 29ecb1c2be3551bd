"""Code comments and docstrings cite only documents inside the repository (docs/, the paper by
number), and every citation they make exists: equation numbers in docs/method.md, numbered
sections of docs/models.md and docs/data.md, named decisions of docs/method.md."""

from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CODE_DIRS = ("mdlmpe_ds", "launch", "benchmarks", "tests")
THIS = Path(__file__).resolve()

# Documents that live outside the repository, and LaTeX labels of the paper's source.
OUTSIDE = re.compile(
    r"MODELS\.md|PERF\.md|ASSETS\.md|ENV\.md|STYLE\.md|(?<![\w/])SPEC(?:'s)?\b|shared/"
    r"|\b(?:eq|app|sec|fig):[A-Za-z_]|\btab:(?!(?:blue|orange|green|red|purple|gray)\b)[A-Za-z_]"
    r"|\bEqs?\.\s+(?!\()[a-z]+_[a-z_]+"
)
EQ_CITE = re.compile(r"\bEqs?\.\s+((?:\(\d+\)(?:\s*(?:,|-|–|\+|and)\s*)?)+)|docs/method\.md \((\d+)\)")
SECTION_CITE = re.compile(r"docs/(models|data)\.md ((?:§[\d.]*\d(?:,\s*)?)+)")
NAMED_CITE = re.compile(r'docs/method\.md\s+"([^"]+)"')


def _python_files() -> list[Path]:
    files = [p for d in CODE_DIRS for p in sorted((ROOT / d).rglob("*.py"))]
    return [p for p in files if p.resolve() != THIS]


def _text_tokens(path: Path) -> list[tuple[int, str]]:
    """(first line, text) of every comment and string literal of a Python file."""
    source = path.read_text(encoding="utf-8")
    kinds = {tokenize.COMMENT, tokenize.STRING, getattr(tokenize, "FSTRING_MIDDLE", tokenize.STRING)}
    return [
        (t.start[0], t.string)
        for t in tokenize.generate_tokens(io.StringIO(source).readline)
        if t.type in kinds
    ]


def _citations(pattern: re.Pattern) -> list[tuple[str, re.Match]]:
    out = []
    for path in _python_files():
        for line, text in _text_tokens(path):
            for m in pattern.finditer(text):
                row = line + text.count("\n", 0, m.start())
                out.append((f"{path.relative_to(ROOT)}:{row}", m))
    return out


def _read(doc: str) -> str:
    return (ROOT / "docs" / doc).read_text(encoding="utf-8")


def test_code_cites_no_document_outside_the_repository():
    hits = [f"{where}: {m.group(0)!r}" for where, m in _citations(OUTSIDE)]
    # The paper's LaTeX labels (listed in docs/method.md) cited instead of equation numbers.
    labels = sorted(set(re.findall(r"`eq:([a-z_]+)`", _read("method.md"))), key=len, reverse=True)
    assert len(labels) >= 30, labels
    by_label = re.compile(r"\bEqs?\.\s+(?:[(\d), ]*)(?:" + "|".join(labels) + r")\b")
    hits += [f"{where}: {m.group(0)!r}" for where, m in _citations(by_label)]
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    hits += [f"README.md: {m.group(0)!r}" for m in re.finditer(r"shared/|MODELS\.md|SPEC §", readme)]
    assert not hits, "references to files outside the repository:\n" + "\n".join(hits)


def test_cited_equation_numbers_are_in_docs_method():
    listed = {int(n) for n in re.findall(r"^\*\*\((\d+)\)\*\*", _read("method.md"), re.MULTILINE)}
    assert listed == set(range(1, len(listed) + 1)) and len(listed) >= 30, sorted(listed)
    missing = []
    for where, m in _citations(EQ_CITE):
        numbers = re.findall(r"\d+", m.group(1) or m.group(2))
        missing += [f"{where}: Eq. ({n})" for n in numbers if int(n) not in listed]
    assert not missing, "equations cited but not in docs/method.md:\n" + "\n".join(missing)


def test_cited_sections_exist():
    headings = {
        doc: set(re.findall(r"^#+\s+(\d+(?:\.\d+)*)\.?\s", _read(f"{doc}.md"), re.MULTILINE))
        for doc in ("models", "data")
    }
    missing = []
    for where, m in _citations(SECTION_CITE):
        for section in re.findall(r"§([\d.]*\d)", m.group(2)):
            # "§1-2" style ranges cite the first section; each number must be a heading.
            if section not in headings[m.group(1)]:
                missing.append(f"{where}: docs/{m.group(1)}.md §{section}")
    assert not missing, "sections cited but absent:\n" + "\n".join(missing)


@pytest.mark.parametrize("doc", ["method.md", "models.md", "data.md", "README.md"])
def test_docs_exist(doc):
    assert (ROOT / "docs" / doc).is_file()


def test_named_decisions_exist():
    text = _read("method.md")
    names = set(re.findall(r"^#+\s+(.+?)\s*$", text, re.MULTILINE))
    names |= set(re.findall(r"^- \*\*(.+?)\.\*\*", text, re.MULTILINE))
    missing = []
    for where, m in _citations(NAMED_CITE):
        name = " ".join(m.group(1).split())
        if name not in names:
            missing.append(f'{where}: docs/method.md "{name}"')
    assert not missing, "names cited but not a heading or decision of docs/method.md:\n" + "\n".join(missing)


def test_code_map_of_docs_method_resolves():
    """Every `alias.name` docs/method.md cites is defined in the file its code map gives the alias."""
    text = _read("method.md")
    aliases = dict(re.findall(r"^\| `([a-z-]+)` \| `([\w/.]+\.py)` \|", text, re.MULTILINE))
    assert len(aliases) >= 10, aliases
    missing = []
    for alias, dotted in re.findall(r"`([a-z-]+)\.([\w.]+)`", text):
        if alias not in aliases:
            continue
        path = ROOT / "mdlmpe_ds" / aliases[alias]
        if not path.is_file():
            missing.append(f"{alias}: {path.relative_to(ROOT)} does not exist")
            continue
        source = path.read_text(encoding="utf-8")
        for name in dotted.split("."):
            if not re.search(rf"^\s*(?:def|class)\s+{name}\b|^\s*{name}\s*[:=]", source, re.MULTILINE):
                missing.append(f"{alias}.{dotted}: no {name!r} in {path.relative_to(ROOT)}")
    assert not missing, "docs/method.md cites code that is not there:\n" + "\n".join(sorted(set(missing)))
