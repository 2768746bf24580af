"""Override values as text: the one parser behind `--config.<key>=<value>` and the
`rollout.<key>=<value>` specs (`--candidate`, `--rollout`, validation's overrides).

`parse_value(raw, current)` parses `raw` for a field now holding `current` as ml_collections'
flag parser does, except that a tuple of bare words in brackets, `(attention, mlp)`, is a tuple
of strings (ml_collections would take the whole text as one string); `split_spec` splits a
comma-separated spec at the commas outside brackets.
"""

from __future__ import annotations

import ast
import re

from absl import flags as absl_flags
from ml_collections.config_flags import tuple_parser

# Calibration prompts per measurement (`mismatch.admission`), here so that the commands' flags
# name the default without importing the measurement (and JAX).
DEFAULT_NUM_PROMPTS = 64


def split_spec(spec: str) -> list[str]:
  """Splits "a=1,b=(0,1),c=x" at the commas outside brackets: ["a=1", "b=(0,1)", "c=x"]."""
  parts, depth, current = [], 0, []
  for ch in spec:
    if ch in "([{":
      depth += 1
    elif ch in ")]}":
      depth -= 1
      if depth < 0:
        raise ValueError(f"candidate {spec!r}: unbalanced {ch!r}")
    if ch == "," and depth == 0:
      parts.append("".join(current))
      current = []
    else:
      current.append(ch)
  if depth:
    raise ValueError(f"candidate {spec!r}: unbalanced brackets")
  parts.append("".join(current))
  return [p.strip() for p in parts]


def literal(raw: str):
  """A value of unknown type, as ml_collections parses one: a Python literal, else the text."""
  if raw in ("true", "false"):
    raw = raw.capitalize()
  try:
    return ast.literal_eval(raw)
  except (SyntaxError, ValueError):
    return raw


def parse_value(raw: str, current):
  """Parses `raw` as ml_collections' `--config.key=raw` would for a field now holding `current`.

  int, float and bool fields use absl's parsers ("1" becomes 1.0 for a float field), tuple
  fields `ast.literal_eval` with a single value wrapped ("0" -> (0,), "(0,1)" -> (0, 1)) and
  bare words in brackets taken as strings ("(mlp,)" -> ("mlp",), `bracketed_tuple`), str
  fields keep the text; a field of another type (or an unknown key) takes a Python literal,
  else the text.

  Raises:
    ValueError: the text does not parse as the field's type.
  """
  parsers = (
    (bool, absl_flags.BooleanParser()),
    (int, absl_flags.IntegerParser()),
    (float, absl_flags.FloatParser()),
    (tuple, tuple_parser.TupleParser()),
  )
  if isinstance(current, tuple) and not isinstance(current, bool):
    bracketed = bracketed_tuple(raw)
    if bracketed is not None:
      return bracketed
  for kind, parser in parsers:
    if isinstance(current, kind):
      return parser.parse(raw)
  if isinstance(current, str):
    return raw
  return literal(raw)


_BARE_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def bracketed_tuple(raw: str) -> tuple | None:
  """A bracketed tuple "(a, b)" or "[a, b]" whose strings may be unquoted: each item a Python
  literal, else a bare word taken as a string ("(mlp,)" -> ("mlp",)); None when `raw` is not
  bracketed.

  Raises:
    ValueError: an item that is neither, with the quoted form to type instead.
  """
  text = raw.strip()
  if len(text) < 2 or (text[0], text[-1]) not in (("(", ")"), ("[", "]")):
    return None
  try:
    value = ast.literal_eval(text)
  except (SyntaxError, ValueError):
    value = None
  if isinstance(value, tuple | list):
    return tuple(value)
  inner = text[1:-1].strip()
  tokens = [t.strip() for t in split_spec(inner)] if inner else []
  if tokens and tokens[-1] == "":
    tokens = tokens[:-1]  # "(mlp,)": the trailing comma of a 1-tuple
  items = []
  for token in tokens:
    try:
      items.append(ast.literal_eval(token))
    except (SyntaxError, ValueError):
      if not _BARE_WORD.fullmatch(token):
        quoted = "(" + ", ".join(repr(t) for t in tokens) + ("," if len(tokens) == 1 else "") + ")"
        raise ValueError(
          f"{raw!r} is not a tuple: {token!r} is neither a value nor a bare word; quote the "
          f"strings: {quoted}"
        ) from None
      items.append(token)
  return tuple(items)
