"""The wheel a user installs: built from a copy of the sources, installed on
its own, it runs the README's quickstart, and its metadata is what a package
index shows (about 10 s: pip fetches setuptools into its build environment).
"""

import email
import pathlib
import re
import shutil
import sys
import zipfile

import pytest
from helpers import checkout_env, run_process

ROOT = pathlib.Path(__file__).resolve().parent.parent
# pyproject.toml's ``dependencies`` (tomllib is Python 3.11's, and 3.10 is supported).
DEPENDENCIES = re.findall(r'"([^"]+)"', re.search(
    r"^dependencies = \[(.*?)\]", (ROOT / "pyproject.toml").read_text(), re.M | re.S)[1])


def readme_quickstart() -> str:
  """The README's quickstart: its first python block."""
  text = (ROOT / "README.md").read_text()
  section = text[text.index("## Quickstart"):]
  return re.search(r"```python\n(.*?)```", section, re.S)[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> pathlib.Path:
  """The wheel ``pip wheel`` builds from a copy of what the sdist holds."""
  tmp = tmp_path_factory.mktemp("package")
  src = tmp / "src"
  src.mkdir()
  for name in ("pyproject.toml", "README.md", "LICENSE"):
    shutil.copy(ROOT / name, src / name)
  shutil.copytree(ROOT / "optaxclip", src / "optaxclip",
                  ignore=shutil.ignore_patterns("__pycache__"))
  result = run_process(
      [sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet",
       "--wheel-dir", str(tmp / "dist"), str(src)], cwd=tmp)
  assert result.returncode == 0, result.stdout + result.stderr
  (built,) = (tmp / "dist").glob("optaxclip-*.whl")
  return built


def test_wheel_metadata(wheel):
  """Name, version, license (file included), Python and dependency bounds,
  project URLs and classifiers, as pyproject.toml declares them."""
  import optaxclip
  with zipfile.ZipFile(wheel) as archive:
    names = archive.namelist()
    info = f"optaxclip-{optaxclip.__version__}.dist-info"
    meta = email.message_from_bytes(archive.read(f"{info}/METADATA"))
  assert meta["Name"] == "optaxclip"
  assert meta["Version"] == optaxclip.__version__
  assert meta["License-Expression"] == "Apache-2.0"
  assert f"{info}/licenses/LICENSE" in names
  assert "optaxclip/py.typed" in names
  assert not [n for n in names if n.startswith(("tests/", "docs/", "benchmarks/"))]
  assert meta["Requires-Python"] == ">=3.10"
  assert DEPENDENCIES and set(meta.get_all("Requires-Dist")) >= set(DEPENDENCIES)
  urls = dict(u.split(", ", 1) for u in meta.get_all("Project-URL"))
  assert {"Homepage", "Documentation", "Source", "Issues", "Changelog"} <= set(urls)
  assert all(u.startswith("https://") for u in urls.values())
  classifiers = meta.get_all("Classifier")
  versions = [c.rsplit(" ", 1)[1] for c in classifiers
              if re.fullmatch(r"Programming Language :: Python :: 3\.\d+", c)]
  assert versions and min(versions, key=lambda v: int(v.split(".")[1])) == "3.10"
  assert "Typing :: Typed" in classifiers
  assert meta.get_payload().startswith("# optaxclip")  # the README, as the index shows it


def test_wheel_runs_the_readme_quickstart(wheel, tmp_path):
  """Installed alone (``pip install --target``, jax and optax from this
  environment), the wheel runs the README's quickstart, which prints what its
  comment says; the checkout is not on the path."""
  site = tmp_path / "site"
  result = run_process(
      [sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--quiet",
       "--target", str(site), str(wheel)], cwd=tmp_path)
  assert result.returncode == 0, result.stdout + result.stderr
  script = tmp_path / "quickstart.py"
  script.write_text(readme_quickstart() + "print(optaxclip.__file__)\n")
  env = checkout_env(JAX_PLATFORMS="cpu")
  env["PYTHONPATH"] = str(site)  # not the checkout
  printed = run_process([sys.executable, str(script)], cwd=tmp_path, env=env)
  assert printed.returncode == 0, printed.stderr
  lines = printed.stdout.splitlines()
  assert lines[0] == "13.0 1.0"  # the comment: pre-clip norm 13.0, clipped 1.0 of steps
  assert pathlib.Path(lines[1]).is_relative_to(site), lines[1]
