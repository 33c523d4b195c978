"""The README's promises kept: its quick start runs and prints what it shows, its links lead somewhere, it stays
a short front page, and the command-line reference names every option the parser declares.

The quick start's output blocks are excerpts: a line ``…`` stands for any number of lines, ``…`` inside a line
for any text, and a number matches within 10 % (an integer exactly), since the arms' numbers are fp16 noise that
BLAS kernels move. Each check has a wrong text it must reject.
"""

from __future__ import annotations

import argparse
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from anelab import cli
from anelab.checkpoints.default import resolve_checkpoint
from anelab.core.paths import REPO_ROOT

README = REPO_ROOT / "README.md"
DOCS = REPO_ROOT / "docs"
README_LIMIT_BYTES = 10_000  # issue 39: a front page a newcomer reads, not the reference
YOUR_MODEL = "path/to/your-model"  # the quick start's placeholder for the reader's own checkpoint
GAP = "…"
NUMBER = r"\d+(?:,\d{3})*(?:\.\d+)?(?:[eE][-+]?\d+)?"
NUMBER_TOLERANCE = 0.10  # relative, for numbers written with a decimal point or an exponent
_FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.MULTILINE | re.DOTALL)


@dataclass
class QuickStartStep:
    """One command of the quick start (``argv`` as typed, ``anelab`` first) and the excerpts shown after it:
    ``stdout`` (a ``text`` block) and ``report`` (a ``markdown`` block: the report.md in the command's ``--out``)."""

    argv: list[str]
    stdout: str | None = None
    report: str | None = None
    extra: list[str] = field(default_factory=list)


def section(text: str, title: str) -> str:
    """The body of the ``## <title>...`` section of a Markdown text (up to the next ``## ``)."""
    match = re.search(rf"^## {re.escape(title)}.*?$(.*?)(?=^## |\Z)", text, re.MULTILINE | re.DOTALL)
    assert match, f"no section '## {title}'"
    return match.group(1)


def quick_start_steps(text: str) -> list[QuickStartStep]:
    """The quick start's ``sh`` blocks (one ``anelab`` command each) with the blocks that follow each."""
    steps: list[QuickStartStep] = []
    for kind, body in _FENCE.findall(section(text, "Quick start")):
        if kind == "sh":
            (line,) = [x for x in body.splitlines() if x.strip()]
            steps.append(QuickStartStep(shlex.split(line)))
        elif kind == "text":
            steps[-1].stdout = body
        elif kind == "markdown":
            steps[-1].report = body
        else:
            steps[-1].extra.append(kind)
    return steps


def _line_pattern(line: str) -> str:
    """One excerpt line as a regex over one output line: numbers captured, ``…`` any text, spaces flexible."""
    out = []
    for part in re.split(rf"({NUMBER}|{GAP}|[ \t]+)", line.strip()):
        if not part:
            continue
        if part == GAP:
            out.append(".*?")
        elif part.isspace():
            out.append("[ \\t]+")
        elif re.fullmatch(NUMBER, part):
            out.append(f"({NUMBER})")
        else:
            out.append(re.escape(part))
    return "[ \\t]*" + "".join(out) + "[ \\t]*"


def _same_number(shown: str, printed: str) -> bool:
    a, b = float(shown.replace(",", "")), float(printed.replace(",", ""))
    if re.fullmatch(r"[\d,]+", shown):
        return a == b
    return abs(a - b) <= NUMBER_TOLERANCE * max(abs(a), abs(b))


def excerpt_problems(excerpt: str, output: str) -> list[str]:
    """Why ``excerpt`` is not what ``output`` printed ([] when it is): its lines in order, consecutive unless a
    ``…`` line lies between, the first and last anchored unless ``…``; each number within ``_same_number``."""
    lines = [x for x in excerpt.strip("\n").splitlines() if x.strip()]
    parts = ["(?:[^\\n]*\\n)*?" if x.strip() == GAP else _line_pattern(x) + "\\n" for x in lines]
    printed = "\n".join(x.rstrip() for x in output.strip("\n").splitlines()) + "\n"
    match = re.fullmatch("".join(parts), printed)
    if match is None:
        return [f"the output does not read as the excerpt:\n{excerpt}\n--- printed ---\n{printed}"]
    shown = [n for x in lines if x.strip() != GAP for n in re.findall(NUMBER, x)]
    return [
        f"the excerpt shows {s}, the output printed {p}"
        for s, p in zip(shown, match.groups(), strict=True)
        if not _same_number(s, p)
    ]


def _out_dir(argv: list[str]) -> Path:
    return Path(argv[argv.index("--out") + 1])


# ---- the quick start runs ------------------------------------------------------------------------------------
def test_the_quick_start_is_three_commands_for_the_real_model_then_yours():
    steps = quick_start_steps(README.read_text())
    assert [s.argv[:2] for s in steps] == [["anelab", "plan"], ["anelab", "decide"], ["anelab", "decide"]]
    assert "default-real" in steps[0].argv and steps[1].argv[2] == "default-real" and steps[2].argv[2] == YOUR_MODEL
    assert steps[0].stdout and steps[1].stdout and steps[1].report and not any(s.extra for s in steps)


def test_the_plan_step_prints_what_the_readme_shows_and_a_wrong_excerpt_is_caught(capsys):
    """The first command, run as written (a second); controls: the excerpt with another verdict, a number off by
    a factor of two, a line the command does not print, and two lines swapped are each rejected."""
    step = quick_start_steps(README.read_text())[0]
    assert cli.main(step.argv[1:]) == 0
    printed = capsys.readouterr().out
    assert excerpt_problems(step.stdout, printed) == []
    wrong_verdict = step.stdout.replace("verdict: gpu", "verdict: ane")
    doubled = step.stdout.replace("0.2883 s [", "0.5766 s [", 1)
    invented = step.stdout.replace("\n…\nto settle", "\nthe ANE wins\n…\nto settle")
    lines = step.stdout.strip("\n").splitlines()
    swapped = "\n".join([lines[0], lines[2], lines[1], *lines[3:]])
    assert doubled != step.stdout and invented != step.stdout and wrong_verdict != step.stdout
    assert excerpt_problems(wrong_verdict, printed) != []
    assert excerpt_problems(doubled, printed) == ["the excerpt shows 0.5766, the output printed 0.2883"]
    assert excerpt_problems(invented, printed) != []
    assert excerpt_problems(swapped, printed) != []


@pytest.mark.slow
def test_the_decide_steps_run_for_the_real_model_and_a_checkpoint_directory(tmp_path, monkeypatch, capsys):
    """The second and third commands as written, from a fresh working directory: decide on default-real (export,
    verify, whole-model arms: about 25 s of CPU) prints the excerpt shown and its report.md holds the one shown;
    the third, with the placeholder replaced by a Hugging Face directory on disk (the embedded dense sibling,
    generated here), prints a verdict and its report's path. Control: the real model's report excerpt is not
    what the other checkpoint's report says."""
    monkeypatch.chdir(tmp_path)
    _, real, yours = quick_start_steps(README.read_text())
    assert cli.main(real.argv[1:]) == 0
    assert excerpt_problems(real.stdout, capsys.readouterr().out) == []
    assert excerpt_problems(real.report, (_out_dir(real.argv) / "report.md").read_text()) == []

    directory = resolve_checkpoint("default-dense")
    assert (directory / "config.json").is_file()
    argv = [str(directory) if a == YOUR_MODEL else a for a in yours.argv[1:]]
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("verdict: ") and f"report: {_out_dir(argv) / 'report.html'}" in printed
    assert excerpt_problems(real.report, (_out_dir(argv) / "report.md").read_text()) != []


# ---- a front page, with links that lead somewhere --------------------------------------------------------------
def test_the_readme_is_a_front_page_with_the_two_set_up_commands():
    text = README.read_text()
    assert len(README.read_bytes()) <= README_LIMIT_BYTES
    setup = section(text, "Set-up")
    assert re.search(r"^make reproduce\b", setup, re.MULTILINE) and re.search(r"^make test\b", setup, re.MULTILINE)
    assert "## Studies" in text and "## Where to go next" in text


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def link_problems(page: Path) -> list[str]:
    """Relative links of a Markdown page whose file, or whose ``#anchor`` heading there, does not exist."""
    problems = []
    for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            problems.append(f"{page.name}: {target}: no such file")
        elif anchor and anchor not in {_slug(h) for h in re.findall(r"^#+ (.*)$", file.read_text(), re.MULTILINE)}:
            problems.append(f"{page.name}: {target}: no such heading")
    return problems


def test_every_link_of_the_readme_and_the_docs_leads_somewhere(tmp_path):
    pages = [README, *DOCS.glob("*.md")]
    assert [p for page in pages for p in link_problems(page)] == []
    assert {"cli.md", "checkpoints.md", "sidecar-contract.md", "verification.md", "studies.md"} <= {
        Path(t).name for t in re.findall(r"\]\((docs/[^)#]+)", README.read_text())
    }
    broken = tmp_path / "page.md"  # control: a missing file and a missing heading
    broken.write_text("# Title\n\n[a](nowhere.md) [b](#title) [c](#no-such-heading) [d](https://example.org)\n")
    assert link_problems(broken) == ["page.md: nowhere.md: no such file", "page.md: #no-such-heading: no such heading"]


# ---- the reference names every option ----------------------------------------------------------------------
def undocumented_options(parser: argparse.ArgumentParser, page: str) -> list[str]:
    """``command --option`` pairs of the parser's subcommands that the page never names."""
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    missing = [f"{name}: not named" for name in commands if not re.search(rf"anelab {name}\b|`{name}\b", page)]
    for name, sub in commands.items():
        options = {o for a in sub._actions for o in a.option_strings if o.startswith("--") and o != "--help"}
        missing += [f"{name} {o}" for o in sorted(options) if not re.search(rf"{re.escape(o)}\b", page)]
    return missing


def test_docs_cli_names_every_command_and_option_of_the_parser():
    page = (DOCS / "cli.md").read_text()
    assert undocumented_options(cli.build_parser(), page) == []
    parser = cli.build_parser()  # control: one option more than the page names
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    sub.choices["plan"].add_argument("--no-such-option")
    assert undocumented_options(parser, page) == ["plan --no-such-option"]


COUNT_WORDS = ("one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve")


def readme_study_count(text: str) -> int | None:
    """The number the README's "<N> study notebooks" names (a word or digits), or None."""
    found = re.search(r"\b(\w+) study notebooks\b", text, re.IGNORECASE)
    if found is None:
        return None
    word = found.group(1).lower()
    return int(word) if word.isdigit() else (COUNT_WORDS.index(word) + 1 if word in COUNT_WORDS else None)


def test_the_readme_counts_the_studies_of_the_table():
    from anelab.publish.studies import STUDIES

    assert readme_study_count(README.read_text()) == len(STUDIES)
    assert readme_study_count("Seven study notebooks reproduce it.") == 7  # control: a stale count is read as such
    assert readme_study_count("no count here") is None
