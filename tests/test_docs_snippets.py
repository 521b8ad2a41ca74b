"""Every ```python block of README.md and docs/*.md runs as written, on the test device (the CPU interpreter in CI).

A block opts out only with a marker on the line before its fence, ``<!-- snippet: gpu-only: <why> -->``; such a
block runs where a CUDA GPU is present and is skipped elsewhere. Shell blocks are not run. Each block must be
self-contained (its own imports and data) and pick its device with ``device = "cuda" if torch.cuda.is_available()
else "cpu"``, so that a reader can paste it as it is.
"""

from __future__ import annotations

import pathlib
import re
import runpy
import warnings

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
DEVICE_LINE = 'device = "cuda" if torch.cuda.is_available() else "cpu"'
GPU_ONLY = re.compile(r"<!--\s*snippet:\s*gpu-only:\s*(?P<why>[^>]*?)\s*-->")
MAX_GPU_ONLY = 3  # opting out is the exception: every other block runs in CI
FENCE = re.compile(r"^(?P<indent> *)```(?P<info>[^\n`]*)$")


def _blocks(path: pathlib.Path) -> list[dict]:
    """The fenced blocks of a markdown file: language, first line number, code, and the marker line before it."""
    lines = path.read_text().splitlines()
    blocks, index = [], 0
    while index < len(lines):
        opening = FENCE.match(lines[index])
        if opening is None:
            index += 1
            continue
        end = index + 1
        while end < len(lines) and not re.match(rf"^{opening['indent']}```\s*$", lines[end]):
            end += 1
        blocks.append(
            {
                "language": opening["info"].strip(),
                "line": index + 1,
                "code": "\n".join(lines[index + 1 : end]) + "\n",
                "before": lines[index - 1] if index else "",
            }
        )
        index = end + 1
    return blocks


def _snippets() -> list[dict]:
    snippets = []
    for path in DOCUMENTS:
        for block in _blocks(path):
            if block["language"] == "python":
                marker = GPU_ONLY.search(block["before"])
                snippets.append(
                    {**block, "path": path.relative_to(ROOT).as_posix(), "gpu_only": marker["why"] if marker else None}
                )
    return snippets


SNIPPETS = _snippets()


def test_snippets_are_found():
    """The collector sees the README's quickstart and the docs' examples."""
    assert any(s["path"] == "README.md" for s in SNIPPETS)
    assert len(SNIPPETS) >= 5, [f"{s['path']}:{s['line']}" for s in SNIPPETS]


def test_few_blocks_opt_out_and_each_says_why():
    gpu_only = [s for s in SNIPPETS if s["gpu_only"] is not None]
    assert len(gpu_only) <= MAX_GPU_ONLY, [f"{s['path']}:{s['line']}" for s in gpu_only]
    for snippet in gpu_only:
        assert len(snippet["gpu_only"].split()) >= 3, (
            f"{snippet['path']}:{snippet['line']}: the gpu-only marker must say why ({snippet['gpu_only']!r})"
        )
    # a marker that does not sit right before a python fence is a typo: it would silently opt nothing out
    for path in DOCUMENTS:
        marked = {block["line"] - 1 for block in _blocks(path) if block["language"] == "python"}
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if "snippet:" in line and line.lstrip().startswith("<!--"):
                assert GPU_ONLY.search(line) and number in marked, f"{path.name}:{number}: misplaced marker {line!r}"


@pytest.mark.parametrize("snippet", SNIPPETS, ids=[f"{s['path']}:{s['line']}" for s in SNIPPETS])
def test_snippet_runs(snippet, device, tmp_path):
    where = f"{snippet['path']}:{snippet['line']}"
    code = snippet["code"]
    if snippet["gpu_only"] is not None:
        if device.type != "cuda":
            pytest.skip(f"gpu-only ({snippet['gpu_only']})")
    else:
        # runs as written on a GPU and on a CPU: the device is chosen once, never hard-coded
        hard_coded = [line for line in code.splitlines() if '"cuda"' in line and line.strip() != DEVICE_LINE]
        assert not hard_coded, f"{where}: use `{DEVICE_LINE}`, not a fixed device: {hard_coded}"
    # from a file, as a reader runs it: Triton compiles a @triton.jit function from its source file (exec'd code has
    # none); the file is named after the block, e.g. docs_usage.md_117.py for the block at docs/usage.md line 117
    script = tmp_path / f"{re.sub(r'[^A-Za-z0-9.]+', '_', snippet['path'])}_{snippet['line']}.py"
    script.write_text(code)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the interpreter warns on masked-out lanes; snippets are checked by asserts
        runpy.run_path(str(script), run_name="__snippet__")


def _links(path: pathlib.Path) -> list[str]:
    text = path.read_text()
    for block in _blocks(path):  # links inside code blocks are code, not links
        text = text.replace(block["code"], "")
    text = re.sub(r"(`+).*?\1", "", text)  # nor inside inline code spans
    return re.findall(r"\]\(([^)\s]+)\)", text)


@pytest.mark.parametrize("path", DOCUMENTS, ids=[p.relative_to(ROOT).as_posix() for p in DOCUMENTS])
def test_relative_links_resolve(path):
    missing = []
    for target in _links(path):
        if re.match(r"^[a-z]+:", target) or target.startswith("#"):
            continue
        if not (path.parent / target.split("#", 1)[0]).exists():
            missing.append(target)
    assert not missing, f"{path.relative_to(ROOT)} links to missing files: {missing}"


def test_readme_keeps_the_two_commands_first():
    """A new machine's two commands are the README's first code block, and the test command is the one .ci/run runs."""
    first = next(block for block in _blocks(ROOT / "README.md"))
    assert "python -m llmkernels demo" in first["code"] and "python -m pytest" in first["code"]
    assert "python3 -m pytest" in (ROOT / ".ci" / "run").read_text()
    readme = (ROOT / "README.md").read_text()
    assert "`.ci/run`" in readme and "python3 -m pytest" in readme


def test_readme_stays_short():
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines <= 250, f"README.md has {lines} lines: move details to docs/ (aim: at most 250)"
