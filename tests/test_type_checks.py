"""The suite's runtime jaxtyping checks reach every jaxtyping-annotated signature.

`conftest.annotated_modules` loads through the import hook only the modules
that import jaxtyping or `jaxkv._types`; a module whose signatures name an
array alias imported from elsewhere would go unchecked without notice.
"""

import importlib
import inspect
import re

import jax.numpy as jnp
import jaxtyping
import pytest

import conftest
import jaxkv._types
from jaxkv._slots import slots_from_block_table

# What a jaxtyping annotation reads as, resolved or as a string (the
# annotations are strings under `from __future__ import annotations`): a
# dtype class subscripted, or one of `jaxkv._types`'s aliases by name.
_DTYPES = [name for name in dir(jaxtyping) if isinstance(getattr(jaxtyping, name), type)
           and issubclass(getattr(jaxtyping, name), jaxtyping.AbstractDtype)]
_ALIASES = [name for name, value in vars(jaxkv._types).items()
            if getattr(value, "__module__", "") == "jaxtyping" and name not in _DTYPES]
_MARKS = re.compile(
    rf"\b(jaxtyping|({'|'.join(_DTYPES)})\[|({'|'.join(_ALIASES)})\b)")


def _functions(module):
  for obj in vars(module).values():
    members = [obj]
    if inspect.isclass(obj) and obj.__module__ == module.__name__:
      members += list(vars(obj).values())
    for member in members:
      member = getattr(member, "__func__", getattr(member, "fget", member))
      if (inspect.isfunction(member) and member.__module__ == module.__name__
          # written in the module (not a dataclass's generated __init__ or __eq__)
          and inspect.unwrap(member).__code__.co_filename == module.__file__):
        yield member


def _is_checked(fn):
  """Whether the hook wrapped `fn` (jaxtyping's `jaxtyped` keeps the original)."""
  return hasattr(fn, "__wrapped__")


def test_every_jaxtyping_annotated_function_is_checked():
  hooked = set(conftest.annotated_modules())
  assert {"jaxkv._slots", "jaxkv.kernels.mla_decode.wrapper",
          "jaxkv.kernels.sparse_mla_decode.wrapper"} <= hooked
  unchecked = []
  for name in conftest.all_modules():
    module = importlib.import_module(name)
    for fn in _functions(module):
      notes = " ".join(str(a) for a in fn.__annotations__.values())
      if name in hooked:
        assert _is_checked(fn), f"{name}.{fn.__qualname__} was loaded without the hook"
      elif _MARKS.search(notes):
        unchecked.append(f"{name}.{fn.__qualname__}")
  assert not unchecked, f"jaxtyping annotations outside the hooked modules: {unchecked}"


def test_a_hooked_signature_refuses_a_wrong_shape():
  """The checks are live: a block table of rank 1 where rank 2 is declared."""
  with pytest.raises(jaxtyping.TypeCheckError, match="block_table"):
    slots_from_block_table(jnp.zeros((4,), jnp.int32), jnp.zeros((4,), jnp.int32), 16)
