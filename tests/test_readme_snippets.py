"""The README's "Use it from…" snippets run as written (on the test device)."""
import pathlib
import re
import warnings

import pytest

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def _snippets() -> list[str]:
    text = README.read_text()
    section = text.split("## Use it from…", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, re.S)


def test_the_section_has_its_snippets():
    assert len(_snippets()) == 4


@pytest.mark.parametrize("index", range(4), ids=["flash_attn", "fused_experts", "torchao", "transformers"])
def test_snippet_runs(index, device):
    code = _snippets()[index]
    assert 'device = "cuda"' in code
    for package in ("torchao", "transformers"):
        if f"import {package}" in code or f"from {package}" in code:
            pytest.importorskip(package)
    namespace = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exec(compile(code.replace('device = "cuda"', f'device = "{device.type}"'), f"README snippet {index}", "exec"),
             namespace)
