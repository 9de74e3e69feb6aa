"""Runs the documentation: every code block under docs/ and the site build.

Conventions the pages follow (see docs/*.md):

- Every fenced ``python`` block is executed, in page order, in one fresh
  namespace per page, so blocks on a page build on each other.
- A fenced ``text`` block that directly follows a python block (only blank
  lines in between) is that block's expected stdout, compared as text,
  exactly: a page shows what its code prints, down to the last digit (a
  tolerance once let three pages show a float32 one ulp away from the one
  their code printed).
- A python block preceded by ``<!-- skip: MODULE -->`` is code for another
  library (torch, tensorflow, mindspore). It is not part of the optaxclip
  run; when MODULE is importable it is run on its own (one namespace per
  page and module) and its output checked the same way: the live check
  that the numbers the pages quote are what that library prints.

Content tabs (``=== "PyTorch"``) indent their blocks; the indentation is
removed before running.

``python tests/test_docs.py docs/PAGE.md`` runs one page's optaxclip blocks
(used to run docs/distributed.md on 8 host devices).
"""

import contextlib
import dataclasses
import html.parser
import importlib.util
import io
import os
import pathlib
import re
import sys
import textwrap

import pytest
from helpers import checkout_env, run_process

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = sorted(p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md"))

_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<ticks>`{3,})(?P<info>[^`]*)$")
_SKIP = re.compile(r"^\s*<!--\s*skip:\s*(?P<module>[\w.]+)\s*-->\s*$")


@dataclasses.dataclass
class Block:
  line: int  # 1-based line of the opening fence
  lang: str
  code: str
  skip: str | None = None  # the reference library, for <!-- skip: ... -->
  expected: str | None = None  # the text block that follows, if any


def parse(path: pathlib.Path) -> list[Block]:
  """The fenced code blocks of a markdown page, expected outputs attached."""
  lines = path.read_text().splitlines()
  blocks: list[Block] = []
  i = 0
  last_python: Block | None = None  # a python block only blank lines follow
  pending_skip: str | None = None
  while i < len(lines):
    line = lines[i]
    skip = _SKIP.match(line)
    if skip:
      pending_skip = skip["module"]
      i += 1
      continue
    fence = _FENCE.match(line)
    if not fence:
      if line.strip():
        last_python = None
        pending_skip = None
      i += 1
      continue
    ticks = fence["ticks"]
    info = fence["info"].strip()
    lang = info.split()[0] if info else ""
    body = []
    j = i + 1
    while j < len(lines) and lines[j].strip() != ticks:
      body.append(lines[j])
      j += 1
    if j == len(lines):
      raise ValueError(f"{path}:{i + 1}: unclosed code fence")
    code = textwrap.dedent("\n".join(body)) + "\n"
    if lang == "text" and last_python is not None:
      last_python.expected = code
      last_python = None
    elif lang == "python":
      block = Block(i + 1, lang, code, skip=pending_skip)
      blocks.append(block)
      last_python = block
    else:
      last_python = None
    pending_skip = None
    i = j + 1
  return blocks


def check_output(actual: str, expected: str, where: str) -> None:
  """``actual`` (what a block printed) is ``expected`` (the page), exactly."""
  assert actual == expected, (
      f"{where}: printed\n{actual}\nbut the page says\n{expected}")


def run_blocks(page: str, blocks: list[Block]) -> None:
  """Executes ``blocks`` in one fresh namespace, checking expected output."""
  namespace: dict = {"__name__": f"docs.{page}"}
  for block in blocks:
    where = f"docs/{page}:{block.line}"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
      exec(compile(block.code, where, "exec"), namespace)  # noqa: S102
    if block.expected is not None:
      check_output(out.getvalue(), block.expected, where)


def _optaxclip_blocks(page: str) -> list[Block]:
  return [b for b in parse(DOCS / page) if b.skip is None]


def test_pages_found():
  assert {"index.md", "which.md", "logging.md", "distributed.md",
          "reference/index.md", "migration/pytorch.md", "migration/tensorflow.md",
          "migration/mindspore.md"} <= set(PAGES)


def test_output_is_compared_exactly():
  """Text one float32 ulp away is a different page: outputs are compared as
  text, not as numbers within a tolerance."""
  shown = "[-0.30656928  0.30656928]\n"
  check_output(shown, shown, "same text")
  for printed in ("[-0.3065693  0.3065693]\n",  # one ulp apart
                  "[-0.30656928 0.30656928]\n",  # spacing
                  "[-0.30656928  0.30656928]\n\n"):  # an extra line
    with pytest.raises(AssertionError, match="but the page says"):
      check_output(printed, shown, "docs/page.md:1")


# Characters of code the content column shows without scrolling (a 1280
# pixel wide window); printed output (``text``) wraps instead (extra.css).
CODE_COLUMNS = 80


def test_code_lines_fit_the_column():
  """No line of code on a page is wider than the column: a reader would have
  to scroll sideways to see its end."""
  offenders = []
  for page in PAGES:
    lines = (DOCS / page).read_text().splitlines()
    fence = None
    for number, line in enumerate(lines, 1):
      opening = _FENCE.match(line)
      if opening and fence is None:
        fence = (len(opening["indent"]), opening["info"].strip().split(" ")[0])
      elif opening:
        fence = None
      elif fence and fence[1] != "text" and len(line) - fence[0] > CODE_COLUMNS:
        offenders.append(f"docs/{page}:{number}: {len(line) - fence[0]} columns")
  assert not offenders, offenders


@pytest.mark.parametrize("page", PAGES)
def test_page_code_blocks(page):
  """Every optaxclip code block on the page runs and prints what it says."""
  run_blocks(page, _optaxclip_blocks(page))


REFERENCE_BLOCKS = sorted({(page, b.skip) for page in PAGES
                           for b in parse(DOCS / page) if b.skip})


@pytest.mark.parametrize("page,module", REFERENCE_BLOCKS)
def test_reference_library_blocks(page, module):
  """Live check: the other library prints the numbers the page quotes."""
  if importlib.util.find_spec(module) is None:
    pytest.skip(f"{module} is not installed: its blocks on {page} are shown, "
                "not run (the optaxclip side is checked by the golden tests)")
  blocks = [b for b in parse(DOCS / page) if b.skip == module]
  assert all(b.expected is not None for b in blocks), (
      f"every {module} block on {page} should show its output")
  run_blocks(page, blocks)


def test_reference_blocks_show_output_and_are_marked():
  """Reference-library code is never run as optaxclip code by mistake."""
  for page in PAGES:
    for block in parse(DOCS / page):
      imports = re.findall(r"^\s*(?:import|from)\s+(\w+)", block.code, re.M)
      if block.skip is None:
        assert not {"torch", "tensorflow", "mindspore", "keras"} & set(imports), (
            f"docs/{page}:{block.line} imports a reference library but has "
            "no <!-- skip: ... --> marker")
      else:
        assert block.expected is not None, f"docs/{page}:{block.line}"


def test_distributed_page_on_8_devices():
  """docs/distributed.md runs on 8 (host) devices as well as on one."""
  env = checkout_env(JAX_PLATFORMS="cpu")
  env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") +
                      " --xla_force_host_platform_device_count=8").strip()
  result = run_process(
      [sys.executable, str(pathlib.Path(__file__)), "distributed.md", "8"],
      env=env, cwd=ROOT)
  assert result.returncode == 0, result.stdout + result.stderr


def test_docstring_links_are_markdown():
  """mkdocstrings renders docstrings as Markdown: an RST link
  (`` `Title <url>`_ ``) would show up literally on the reference page."""
  rst_link = re.compile(r"<https?://[^>]+>`_")
  offenders = [f"{path.name}: {match.group(0)}"
               for path in sorted((ROOT / "optaxclip").glob("*.py"))
               for match in rst_link.finditer(path.read_text())]
  assert not offenders, offenders


def _public_docstrings():
  """(name, docstring) of everything the API reference renders: the public
  names of optaxclip and optaxclip.functional, and their public members."""
  import optaxclip
  from optaxclip import functional
  for module in (optaxclip, functional):
    yield module.__name__, module.__doc__ or ""
    for name in module.__all__:
      obj = getattr(module, name)
      yield f"{module.__name__}.{name}", obj.__doc__ or ""
      if isinstance(obj, type):
        for attr, member in vars(obj).items():
          member = getattr(member, "__func__", member)
          if not attr.startswith("_") and callable(member):
            yield f"{module.__name__}.{name}.{attr}", member.__doc__ or ""


def test_docstring_docs_mentions_are_links():
  """A docstring that points to a docs page links it, ``[docs/x.md](../x.md)``
  (relative to the reference pages, docs/reference/*.md, where mkdocs
  resolves and checks it): plain ``docs/x.md`` is dead text on the site."""
  link = re.compile(r"\[[^\]]*\]\([^)]*\)")
  offenders = [f"{name}: {m.group(0)}" for name, doc in _public_docstrings()
               for m in re.finditer(r"docs/[\w/-]+\.md", link.sub("", doc))]
  assert not offenders, offenders


def test_docstring_lines_are_not_markdown_quotes():
  """A docstring line that starts with ``>`` (``>= 0)`` wrapped to the start
  of a line) renders as a block quote on the reference page."""
  offenders = [f"{name}: {line.strip()}" for name, doc in _public_docstrings()
               for line in doc.splitlines()
               if re.match(r"\s*>(?!>>)", line)]
  assert not offenders, offenders


def test_reference_lists_every_public_name():
  """Every public name has its entry in the reference (a ``:::`` block on one
  of docs/reference/*.md) and a row in the summary table at its top."""
  import optaxclip
  from optaxclip import functional
  pages = {p.name: p.read_text() for p in (DOCS / "reference").glob("*.md")}
  summary = pages.pop("index.md")
  blocks = set(re.findall(r"^::: ([\w.]+)$", "\n".join(pages.values()), re.M))
  names = {f"optaxclip.{n}" for n in optaxclip.__all__ if n != "functional"}
  names |= {f"optaxclip.functional.{n}" for n in functional.__all__}
  assert names - blocks == set(), "no ::: entry on docs/reference/*.md"
  assert blocks - names == set(), "an entry for a name that is not public"
  rows = set(re.findall(r"^\| \[`\w+`\]\[([\w.]+)\] \|", summary, re.M))
  assert names - rows == set(), "no row in docs/reference/index.md"


_DOCS_EXTRA = ("pip install -e '.[docs]' (the docs extra in pyproject.toml; "
               "`make docs` installs it)")


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> pathlib.Path:
  """The site, built once with ``mkdocs build --strict`` (about 2 s)."""
  for module in ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers"):
    if importlib.util.find_spec(module) is None:
      pytest.skip(f"{module} is not installed: {_DOCS_EXTRA}")
  out = tmp_path_factory.mktemp("site")
  env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
  result = run_process(
      [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir",
       str(out)], cwd=ROOT, env=env)
  assert result.returncode == 0, result.stdout + result.stderr
  return out


def test_mkdocs_build_strict(site):
  """The site builds with ``mkdocs build --strict``: no warnings at all."""
  reference = (site / "reference" / "adaptive" / "index.html").read_text()
  assert '<a href="https://arxiv.org/abs/2504.02507">' in reference  # ZClip


class _Text(html.parser.HTMLParser):
  """The text of an HTML page as a reader sees it, code and prose apart
  (HTML comments, which a browser does not show, are dropped)."""

  def __init__(self):
    super().__init__(convert_charrefs=True)
    self.prose: list[str] = []
    self.code: list[str] = []
    self._skip = 0  # inside <script>/<style>
    self._pre = 0

  def handle_starttag(self, tag, attrs):
    self._skip += tag in ("script", "style")
    self._pre += tag == "pre"

  def handle_endtag(self, tag):
    self._skip -= tag in ("script", "style") and self._skip > 0
    self._pre -= tag == "pre" and self._pre > 0

  def handle_data(self, data):
    if not self._skip:
      (self.code if self._pre else self.prose).append(data)


# Markdown that shows up as text when its extension is missing or a block is
# indented wrongly: a content tab, a code fence, an admonition, an HTML
# comment (``<!-- skip: torch -->``) or a snippet include.
_UNRENDERED = re.compile(r'^\s*(=== "|```|!!! |\?\?\? |--8<--)|<!--', re.M)


def unrendered(page_html: str) -> list[str]:
  """The lines of a built page's text that are Markdown left unrendered."""
  text = _Text()
  text.feed(page_html)
  return [m.group(0).strip() + " in: " + line.strip()[:80]
          for part in text.prose + text.code
          for line in part.splitlines()
          if (m := _UNRENDERED.search(line))]


def test_unrendered_markup_is_caught():
  """The check sees what the migration pages showed without pymdownx.tabbed:
  the tab title and the fences as text, the skip comment inside a code block."""
  broken = ('<p>=== "PyTorch"</p><pre><code>&lt;!-- skip: torch --&gt;\n'
            '```python\nimport torch\n```</code></pre>')
  assert len(unrendered(broken)) == 4  # the title, the comment, two fences
  fine = ('<!-- skip: torch --><div class="tabbed-set"><label>PyTorch</label>'
          '<pre><code>import torch</code></pre></div><p>a == b</p>')
  assert unrendered(fine) == []


def test_every_page_renders(site):
  """No page of the built site shows Markdown as text (a content tab, a code
  fence or an HTML comment): ``--strict`` does not see those."""
  pages = sorted(site.rglob("*.html"))
  assert len(pages) > len(PAGES)
  offenders = [f"{page.relative_to(site)}: {line}" for page in pages
               for line in unrendered(page.read_text())]
  assert not offenders, "\n".join(offenders)


def test_markdown_extensions_cover_the_pages():
  """Every Markdown extension a page's syntax needs is enabled in mkdocs.yml
  (without mkdocs installed: the site test above then skips)."""
  config = (ROOT / "mkdocs.yml").read_text()
  needs = {r'^\s*=== "': "pymdownx.tabbed", r"^!!! ": "admonition",
           r"^\?\?\? ": "pymdownx.details", r"^--8<--": "pymdownx.snippets",
           r"^\s*```": "pymdownx.superfences", r"^\|.*\|$": "tables"}
  for page in PAGES:
    text = (DOCS / page).read_text()
    for pattern, extension in needs.items():
      if re.search(pattern, text, re.M):
        assert re.search(rf"^  - {re.escape(extension)}\b", config, re.M), (
            f"docs/{page} needs {extension}, not enabled in mkdocs.yml")


if __name__ == "__main__":
  page = sys.argv[1]
  if len(sys.argv) > 2:
    import jax
    assert jax.device_count() == int(sys.argv[2]), jax.devices()
  run_blocks(page, _optaxclip_blocks(page))
  print(f"docs/{page}: {len(_optaxclip_blocks(page))} blocks ran")
