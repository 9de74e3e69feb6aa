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
TRANSFORMS = {"_adaptive.adagc", "_adaptive.autoclip", "_adaptive.zclip",
              "_attention.qk_clip", "_clip.agc", "_clip.block_rms", "_clip.norm",
              "_clip.per_example", "_clip.value",
              "_guards.loss_scale", "_guards.microbatch", "_guards.skip"}
# The family folders, bottom to top: a module imports only from its own
# layer or the ones below (helpers are the loose modules beside them).
LAYERS = ["_core", "_stats", "_clip", "_attention", "_adaptive", "_guards"]


def _module_name(path: pathlib.Path) -> str:
  return ".".join(path.relative_to(PACKAGE).with_suffix("").parts)


def _imported_modules(path: pathlib.Path) -> set[str]:
  """The optaxclip modules ``path`` imports, dotted below the package."""
  found = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if not isinstance(node, ast.ImportFrom) or not (node.module or "").startswith("optaxclip"):
      continue
    base = node.module.removeprefix("optaxclip").lstrip(".")
    for alias in node.names:
      name = f"{base}.{alias.name}" if base else alias.name
      found.add(name if (PACKAGE / name.replace(".", "/")).with_suffix(".py").exists()
                or (PACKAGE / name.replace(".", "/")).is_dir() else base)
  return found


@pytest.mark.parametrize("module", sorted(TRANSFORMS))
def test_no_transform_imports_another_transforms_module(module):
  path = PACKAGE / (module.replace(".", "/") + ".py")
  others = _imported_modules(path) & TRANSFORMS - {module}
  assert not others, f"{module} imports {others}: share code through a neutral module"


def test_families_import_only_downwards():
  """No import runs back up the layers, so the folders show the architecture."""
  upward = []
  for path in PACKAGE.rglob("*.py"):
    here = _module_name(path).split(".")[0]
    if here not in LAYERS:
      continue
    for name in _imported_modules(path):
      there = name.split(".")[0]
      if there in LAYERS and LAYERS.index(there) > LAYERS.index(here):
        upward.append(f"{_module_name(path)} imports {name}")
  assert not upward, upward
  helpers = {path.stem for path in PACKAGE.glob("_*.py")} - {"__init__"}
  assert helpers <= {"_static", "_tree", "_types", "_validation"}, (
      "transform modules belong in a family folder")


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
