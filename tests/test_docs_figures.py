"""Every measured figure in docs/ is one a results file holds (benchmarks/results/), so a doc cannot drift from
the measurement it quotes.

A figure is a number with a unit of time, size, rate or share (`0.42 s`, `473 MB/s`, `17%`), a ratio (`1.66x`),
a count out of a total (`578/578`), a number in scientific notation (`3.0e4`) or a decimal with at least two
decimals (`0.425`, the ratio of a margin), unless it is a version (`Python 3.11`). Each must be held by a results
file that its section names (a link to or a mention of `benchmarks/results/<file>`), or that the page's opening
section names for the whole page: as written, or as a number there that rounds to it at the digits the doc
shows (`3.0e4` is held by `30412.7`; `578/578` by both its numbers). Not figures: numbers in code spans and code
blocks (commands, flags, configuration), and a target, bound or constant the text states as such ("target
1.5x", "at most 1 MiB", "tolerance 1e-5").
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
RESULTS = "benchmarks/results/"

_UNIT = r"(?:x\b|\s?(?:ms|s|MB/s|GB/s|MB|GB|MiB|GiB|KiB|KB|%)(?![\w/]))"
FIGURE = re.compile(
    r"(?<![\w.#/-])("
    rf"\d+(?:[.,]\d+)*(?:e[+-]?\d+)?{_UNIT}"  # 1.66x, 0.42 s, 473 MB/s, 17%
    r"|\d+(?:,\d+)*/\d+(?:,\d+)*\b"  # 578/578
    r"|\d+(?:\.\d+)?e[+-]?\d+\b"  # 3.0e4
    r"|\d+\.\d{2,}(?![.\d\w])"  # 0.425
    r")")
# A figure the text states as a goal or a bound, not as a measurement.
STATED = re.compile(r"(?:target|targets of|at most|up to|limit of|budget of|budgets of|above|below|tolerance|rel|eps|u =)\s+$",
                    re.I)
# A version, or a constant of a formula ("C = 1.03"), is not a measurement either.
NAMED = re.compile(r"(?:python|torch|transformers|megatron-core|torchtitan|triton|version|release|\b[a-z] =)\s+$", re.I)
NUMBER = re.compile(r"\d+(?:,\d{3})*(?:\.\d+)?(?:e[+-]?\d+)?")


def sections(text: str) -> list[str]:
    """The page cut at its headings (`# ` to `###### `), with code blocks, fenced or indented, left out."""
    found, current, fence = [], [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fence = not fence
            continue
        if fence or (line.startswith("    ") and (not current or not current[-1].strip())):
            continue  # a code line; an indented line right after prose is a list item's continuation
        if re.match(r"#{1,6} ", line) and current:
            found.append("\n".join(current))
            current = []
        current.append(line)
    found.append("\n".join(current))
    return found


def figures(section: str) -> list[str]:
    prose = re.sub(r"`[^`]*`", "``", section)
    return [m.group(1) for m in FIGURE.finditer(prose) 
            if not STATED.search(prose[max(0, m.start() - 20):m.start()])
            and not NAMED.search(prose[max(0, m.start() - 20):m.start()])]


def named_results(section: str) -> list[str]:
    return sorted(set(re.findall(re.escape(RESULTS) + r"[\w.\-]+\.(?:md|json|csv)", section)))


def _flat(text: str) -> str:
    return " ".join(text.replace("**", "").replace("`", "").split())


def _numbers(text: str) -> set[float]:
    """The numbers a results file states, as whole tokens (`11` in `0/11` is one, `1` in `0.1` is not)."""
    return {float(n.replace(",", "")) for n in re.findall(r"(?<![\w.])" + NUMBER.pattern + r"(?![\w]|\.\d)", text)}


def _rounds_to(shown: str, held: set[float]) -> bool:
    """Whether a number held rounds to `shown` at the significant digits `shown` has."""
    mantissa = re.sub(r"e[+-]?\d+$", "", shown.replace(",", "")).replace(".", "").lstrip("0") or "0"
    digits, value = max(len(mantissa), 1), float(shown.replace(",", ""))
    return any(float(f"{number:.{digits}g}") == value for number in held if number)


def held(figure: str, text: str, numbers: set[float]) -> bool:
    if re.search(r"(?<![\w.])" + re.escape(_flat(figure)) + r"(?![\w]|\.\d)", text):
        return True
    return all(_rounds_to(shown, numbers) for shown in NUMBER.findall(figure))


def unbacked(page: Path) -> list[str]:
    """Each figure of the page that no results file its section (or its opening section) names holds."""
    parts = sections(page.read_text())
    page_wide = named_results(parts[0])
    problems = []
    for part in parts:
        wanted = figures(part)
        if not wanted:
            continue
        names = sorted(set(page_wide + named_results(part)))
        missing_files = [name for name in names if not (ROOT / name).is_file()]
        problems += [f"{page.name}: names {name}, which does not exist" for name in missing_files]
        texts = [_flat((ROOT / name).read_text()) for name in names if name not in missing_files]
        numbers = set().union(*(_numbers(text) for text in texts))
        heading = part.splitlines()[0][:60]
        for figure in wanted:
            if not any(held(figure, text, numbers) for text in texts):
                where = ", ".join(names) or "no results file"
                problems.append(f"{page.name} [{heading}]: {figure!r} is not in {where}")
    return problems


@pytest.mark.parametrize("page", sorted(DOCS.glob("*.md")), ids=lambda p: p.name)
def test_every_figure_is_a_results_figure(page: Path):
    assert unbacked(page) == []


def test_the_check_catches_a_drifted_figure(tmp_path: Path):
    """A planted page: a figure its results file holds passes; one it does not, or one with no file named, fails."""
    results = sorted((ROOT / RESULTS).glob("*.md"))[0]
    held = FIGURE.search(_flat(results.read_text()))
    assert held, results
    name = f"{RESULTS}{results.name}"
    page = tmp_path / "page.md"
    page.write_text(f"# A page\n\nMeasured in [{name}](../{name}): {held.group(1)}.\n\n## Other\n\nTarget 9.99x. `7.77x`.\n")
    assert unbacked(page) == []
    page.write_text(f"# A page\n\nMeasured in [{name}](../{name}): 123456.7x.\n")
    assert unbacked(page) == [f"page.md [# A page]: '123456.7x' is not in {name}"]
    number = max(_numbers(_flat(results.read_text())))
    page.write_text(f"# A page\n\nMeasured in [{name}](../{name}): ratio {number:.2e}.\n")
    assert unbacked(page) == []
    page.write_text("# A page\n\nIt reads at 473 MB/s.\n")
    assert unbacked(page) == ["page.md [# A page]: '473 MB/s' is not in no results file"]


def _bash_blocks(text: str) -> list[list[str]]:
    return [block.strip().splitlines() for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S)]


def test_the_user_script_walk_is_the_one_measured():
    """docs/your-own-script.md's commands are the ones benchmarks/walkthrough.py ran, in order, and the page
    names that results file (so the figures test holds its pass counts, first divergence and culprits)."""
    page = (DOCS / "your-own-script.md").read_text()
    measured = _bash_blocks((ROOT / RESULTS / "walkthrough.md").read_text())[0]
    assert measured in [[line.split("  #")[0].rstrip() for line in block] for block in _bash_blocks(page)]
    assert f"{RESULTS}walkthrough.md" in page
