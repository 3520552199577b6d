"""The README and the guide under docs/ stay whole: every relative link and `#anchor` resolves, the README's quick-start
commands still parse, and CI runs the README's test command as written.

Anchors are computed as GitHub computes them from headings: lowercase, punctuation dropped (letters, digits, `-` and
`_` kept), each space a `-`; a repeated heading gets `-1`, `-2`, ... Links and headings inside fenced code blocks and
inline code spans do not count. External links (`https:`, `mailto:`, ...) are not fetched.
"""

from __future__ import annotations

import re
import shlex
import unicodedata
from pathlib import Path

import pytest

from erniekit_lite import cli

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1", re.S)
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) for every line outside fenced code blocks (``` or ~~~)."""
    out, fence = [], None
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.lstrip()
        marker = stripped[:3]
        if marker in ("```", "~~~"):
            if fence is None:
                fence = marker
            elif marker == fence:
                fence = None
            continue
        if fence is None:
            out.append((number, line))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading counts by its text
    text = re.sub(r"<[^>]+>", "", text).lower()
    kept = "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in "LNM")
    return kept.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    found = set()
    for _, line in prose_lines(path.read_text(encoding="utf-8")):
        match = HEADING.match(line)
        if not match:
            continue
        base = slug(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def links(path: Path) -> list[tuple[int, str]]:
    """(line number, target) of every Markdown link and image outside code."""
    lines = prose_lines(path.read_text(encoding="utf-8"))
    text = "\n".join(line for _, line in lines)
    numbers = [number for number, _ in lines]
    text = CODE_SPAN.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)  # keep offsets and line breaks
    return [(numbers[text.count("\n", 0, m.start())], m.group(1)) for m in LINK.finditer(text)]


def test_slug_follows_github():
    assert slug("Reward models (`method: rm`)") == "reward-models-method-rm"
    assert slug("ERNIE-4.5-21B-A3B (MoE)") == "ernie-45-21b-a3b-moe"
    assert slug("GGUF for llama.cpp and Ollama") == "gguf-for-llamacpp-and-ollama"
    assert slug("Serve: an OpenAI-compatible server") == "serve-an-openai-compatible-server"
    assert slug("GRPO: packed vs TRL's padded scoring") == "grpo-packed-vs-trls-padded-scoring"


def test_duplicate_headings_are_numbered(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# A\n\n## Tested\n\n```\n## Tested\n```\n\n## Tested\n\n### Tested\n", encoding="utf-8")
    assert anchors(page) == {"a", "tested", "tested-1", "tested-2"}


def test_links_outside_code_only(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("[a](x.md) `[b](y.md)` [`c`](#c)\n\n```\n[d](z.md)\n```\n![e](f.png)\n", encoding="utf-8")
    assert links(page) == [(1, "x.md"), (1, "#c"), (6, "f.png")]


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_every_relative_link_and_anchor_resolves(page):
    broken = []
    for number, target in links(page):
        if SCHEME.match(target):
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        where = f"{page.relative_to(ROOT)}:{number}: {target}"
        if not dest.exists():
            broken.append(f"{where} (no such file)")
        elif anchor and dest.suffix != ".md":
            broken.append(f"{where} (an anchor into a file that is not Markdown)")
        elif anchor and anchor not in anchors(dest):
            broken.append(f"{where} (no heading gives #{anchor})")
    assert not broken, "\n".join(broken)


def quick_start_commands() -> list[list[str]]:
    """Each command of the fenced blocks in the README's quick start (the text before its first `##` heading)."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    quick = text[: re.search(r"^## ", text, re.M).start()]
    commands = []
    for block in re.findall(r"^```[^\n]*\n(.*?)^```", quick, re.M | re.S):
        for line in block.splitlines():
            line = line.split(" #")[0]
            commands += [shlex.split(part) for part in line.split("&&") if part.strip()]
    return commands


def test_quick_start_is_the_two_commands():
    commands = quick_start_commands()
    assert [c[:2] for c in commands if c[0] == "erniekit-lite"] == [["erniekit-lite", "tiny"], ["erniekit-lite", "train"]]
    assert ["python", "-m", "pytest"] in commands


@pytest.mark.parametrize("command", [c for c in quick_start_commands() if c[0] == "erniekit-lite"], ids=lambda c: c[1])
def test_quick_start_commands_parse(command, monkeypatch, capsys):
    sub = command[1]
    with pytest.raises(SystemExit) as done:
        cli.main([sub, "--help"])
    assert done.value.code == 0, capsys.readouterr().err
    called = []
    monkeypatch.setattr(cli, f"_{sub}", lambda args: called.append(args) or 0)  # parse only: the handler is not run
    assert cli.main(command[1:]) == 0
    assert len(called) == 1 and called[0].command == sub


def test_ci_runs_the_readme_test_command():
    """.ci/run ends with the README's test command, copied verbatim under a marker comment."""
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    command = ci[ci.index("# The README's test command, exactly:") + 1]
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    quick = text[: re.search(r"^## ", text, re.M).start()]
    assert f"```bash\n{command}\n```" in quick
    assert command.endswith("python -m pytest")


def test_the_readme_recipe_table_lists_every_shipped_model_recipe():
    """Each shipped recipe for a released model (under recipes/<model>/) has a row of the README's table (the six VL
    recipes were missing): `a/{b,c}.yaml` and a row's later `d.yaml` (in the row's first folder) both count."""
    from erniekit_lite import shipped

    text = (ROOT / "README.md").read_text(encoding="utf-8")
    table = text[text.index("| model | method | recipe under `recipes/` | GPU |"):]
    listed = set()
    for row in table[: table.index("\n\n")].splitlines()[2:]:
        paths = [p for p in re.findall(r"`([^`]+\.yaml)`", row)]
        folder = paths[0].rsplit("/", 1)[0]
        for path in paths:
            head, _, tail = path.partition("{")
            names = [head + part + tail.partition("}")[2] for part in tail.partition("}")[0].split(",")] if tail else [path]
            listed |= {(n if "/" in n else f"{folder}/{n}").removesuffix(".yaml") for n in names}
    assert {name for name in shipped.names() if "/" in name} - listed == set()
