"""Every section that the code and the docs point a reader to exists in the page they name."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("mcallreduce/**/*.py", "mcallreduce/**/*.c", "mcallreduce/**/*.h", "tests/**/*.py",
           "examples/**/*.py", "docs/*.md", "README.md")
# `docs/benchmarks.md, "Commands"` or, inside docs/, `benchmarks.md, "Commands"`
REFERENCE = re.compile(r'(?:docs/)?([a-z0-9-]+\.md)[,:]?\s+\(?"([^"]+)"')


def joined(text: str) -> str:
    """The text with wrapped lines, comment leaders and split string literals joined up."""
    text = re.sub(r'"\s*\n\s*f?"', "", text.replace('\\"', '"'))
    return re.sub(r"\s*\n\s*(?:#|\*|//)?\s*", " ", text)


def sections(page: Path) -> list:
    """A page's headings, and the bold lead-ins (`**One sync.**`) that name its paragraphs."""
    text = page.read_text()
    heads = [h.lstrip("#").strip() for h in text.splitlines() if re.match(r"#{1,6} ", h)]
    return heads + re.findall(r"^\*\*([^*]+?)\.?\*\*", text, re.M)


def references() -> list:
    found = []
    for pattern in SOURCES:
        for source in sorted(ROOT.glob(pattern)):
            for page, name in REFERENCE.findall(joined(source.read_text(errors="replace"))):
                found.append((source.relative_to(ROOT), page, name))
    return found


def test_the_pattern_finds_the_references():
    # a pattern that matched nothing would pass the test below vacuously
    pages = {page for _, page, _ in references()}
    assert {"benchmarks.md", "algorithms.md", "cluster.md"} <= pages


def test_every_referenced_section_exists():
    cache, missing = {}, []
    for source, page, name in references():
        path = ROOT / ("README.md" if page == "README.md" else f"docs/{page}")
        if not path.exists():
            missing.append(f"{source}: {page} does not exist")
            continue
        names = cache.setdefault(page, [s.lower() for s in sections(path)])
        if not any(s.startswith(name.lower()) for s in names):
            missing.append(f'{source}: {page} has no section "{name}"')
    assert not missing, "\n".join(missing)
