"""The package's layout: transforms share code only through neutral modules,
and every state documents its fields where the API reference shows them."""

import ast
import inspect
import pathlib
import re

import pytest

import optaxclip as oc

PACKAGE = pathlib.Path(oc.__file__).parent
# Modules that define a transform (a public builder); the rest are neutral.
TRANSFORMS = {"_adagc", "_agc", "_autoclip", "_block_rms", "_loss_scale", "_microbatch",
              "_norm_clipping", "_per_example", "_skip", "_value", "_zclip"}


def _imported_modules(path: pathlib.Path) -> set[str]:
  found = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.ImportFrom) and node.module == "optaxclip":
      found |= {alias.name for alias in node.names}
    elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("optaxclip."):
      found.add(node.module.split(".")[1])
  return found


@pytest.mark.parametrize("module", sorted(TRANSFORMS))
def test_no_transform_imports_another_transforms_module(module):
  others = _imported_modules(PACKAGE / f"{module}.py") & TRANSFORMS - {module}
  assert not others, f"{module} imports {others}: share code through a neutral module"


# Every public state with fields (ValueClipState has none), new ones too.
STATES = [state for state in (getattr(oc, name) for name in oc.__all__)
          if inspect.isclass(state) and issubclass(state, tuple)
          and getattr(state, "_fields", ())]


@pytest.mark.parametrize("state", STATES, ids=lambda s: s.__name__)
def test_state_documents_every_field_in_its_docstring(state):
  doc = inspect.getdoc(state) or ""
  assert "Attributes:" in doc
  attributes = doc.split("Attributes:", 1)[1]
  documented = re.findall(r"^  (\w+):", attributes, re.M)
  assert documented == list(state._fields)
