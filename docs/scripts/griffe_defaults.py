"""A griffe extension for the API reference: defaults shown as values.

A signature such as ``floor: Scalar | None = DEFAULT_FLOOR`` names a module
constant; the reference shows its value instead (``= 0.0001``), which is
what a reader wants to know. Only upper-case names bound to a literal number
or string are replaced; everything else is left as written.
"""

import ast

import griffe


def _literal(obj: griffe.Object | griffe.Alias) -> str | None:
  """The source of ``obj``'s value when it is a literal constant."""
  try:
    target = obj.final_target if isinstance(obj, griffe.Alias) else obj
  except (griffe.AliasResolutionError, griffe.CyclicAliasError):
    return None
  value = getattr(target, "value", None)
  if value is None:
    return None
  try:
    ast.literal_eval(str(value))
  except (ValueError, SyntaxError):
    return None
  return str(value)


def _functions(obj: griffe.Object):
  for member in obj.members.values():
    if isinstance(member, griffe.Alias):
      continue
    if isinstance(member, griffe.Function):
      yield member
    elif isinstance(member, (griffe.Module, griffe.Class)):
      yield from _functions(member)


class ConstantDefaults(griffe.Extension):
  """Replaces ``NAME`` defaults by the literal value ``NAME`` is bound to."""

  def on_package(self, *, pkg: griffe.Module, **kwargs) -> None:
    del kwargs
    for function in _functions(pkg):
      for parameter in function.parameters:
        name = str(parameter.default) if parameter.default is not None else ""
        if not name.isidentifier() or not name.isupper():
          continue
        scope = function.parent
        while scope is not None and name not in scope.members:
          scope = scope.parent
        value = _literal(scope.members[name]) if scope is not None else None
        if value is not None:
          parameter.default = value
