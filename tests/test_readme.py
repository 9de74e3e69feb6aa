"""Every Python block in the README runs, and prints what the README says."""

import contextlib
import io
import pathlib
import re

import pytest

README = pathlib.Path(__file__).parent.parent / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


def test_readme_has_python_blocks():
  assert BLOCKS


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_block_runs(index):
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    exec(compile(BLOCKS[index], f"README.md[block {index}]", "exec"), {})
  if index == 0:
    assert out.getvalue().split() == ["13.0", "1.0"]
