"""Check every relative markdown link and #anchor in README.md, CHANGELOG.md, docs/*.md and
benchmarks/**/README.md.

Anchors are GitHub's heading slugs (lower case; punctuation but ``-`` and ``_`` dropped;
spaces to ``-``; a repeated slug gets ``-1``, ``-2``, ...) plus explicit
``<a id="...">`` / ``<a name="...">`` anchors. Links inside code (fenced blocks, inline
backticks) and absolute URLs are not checked. Prints one line per broken link and exits 1
if there is any; otherwise prints how many links it checked and exits 0.

    python tools/check_md_links.py [ROOT]
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HTML_ANCHOR = re.compile(r"<a\s+(?:id|name)=\"([^\"]+)\"", re.IGNORECASE)
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
FENCE = re.compile(r"^\s*(```|~~~)")


def _prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks, inline code removed."""
    out, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append((number, re.sub(r"`[^`]*`", "``", line)))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links keep their text
    text = re.sub(r"<[^>]+>", "", text)  # html tags go
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)  # punctuation goes; letters, digits, _ and - stay
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = path.read_text(encoding="utf-8")
    found: set[str] = set(HTML_ANCHOR.findall(text))
    seen: dict[str, int] = {}
    fenced = False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        match = None if fenced else HEADING.match(line)
        if match:
            base = slug(match.group(2))
            count = seen.get(base, 0)
            found.add(base if count == 0 else f"{base}-{count}")
            seen[base] = count + 1
    return found


def check(root: Path) -> tuple[int, list[str]]:
    files = [
        root / "README.md",
        root / "CHANGELOG.md",
        *sorted((root / "docs").glob("*.md")),
        *sorted((root / "benchmarks").glob("**/README.md")),
    ]
    cache: dict[Path, set[str]] = {}
    checked, broken = 0, []
    for source in files:
        if not source.exists():
            continue
        for number, line in _prose_lines(source.read_text(encoding="utf-8")):
            for target in LINK.findall(line):
                if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):
                    continue  # http:, https:, mailto:
                checked += 1
                where = f"{source.relative_to(root)}:{number}: {target}"
                path_part, _, anchor = target.partition("#")
                dest = (source.parent / path_part).resolve() if path_part else source
                if not dest.exists():
                    broken.append(f"{where}: no such file")
                    continue
                if anchor and dest.suffix == ".md":
                    if dest not in cache:
                        cache[dest] = anchors(dest)
                    if anchor not in cache[dest]:
                        broken.append(f"{where}: no heading or anchor '#{anchor}'")
    return checked, broken


def main(argv: list[str]) -> int:
    root = Path(argv[1] if len(argv) > 1 else Path(__file__).resolve().parent.parent)
    checked, broken = check(root)
    for line in broken:
        print(line)
    print(f"{checked} relative links checked, {len(broken)} broken", file=sys.stderr)
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
