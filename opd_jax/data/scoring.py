"""Scorers of held-out completions against reference answers (`data.eval_metric`).

A scorer is a function `(prompt: str, completion: str, answer: str) -> float`: the prompt's
text as the model saw it (a chat record's rendered template included), the decoded greedy
completion (up to the first eos, special tokens dropped) and the record's "answer" field.
`data.eval_metric` names one:

    exact_match                 1.0 if final_answer(completion) == answer.strip(), else 0.0
    none                        no scoring: the held-out quality is the KL alone
    "package.module:function"   any function with that signature, imported by `resolve`
                                (the module must be importable: installed, or on sys.path,
                                which holds the working directory under `python -m`)

`final_answer(completion)` is, in this order of precedence:

  1. the contents of the last `\\boxed{...}` (braces balanced, so `\\boxed{\\frac{1}{2}}`
     gives `\\frac{1}{2}`; an unclosed one gives everything after its brace);
  2. else the rest of the line after the last `####` (the GSM8K convention);
  3. else the last line of the completion that is not blank;

stripped of surrounding whitespace. The comparison is exact and case-sensitive: "4." and
"four" do not match "4". Anything else (normalising numbers, units, LaTeX) belongs in a
scorer of its own.

The score of a held-out set is the mean over the records that carry an "answer" (records
without one count only in the KL); `answers` reads and checks that field.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Sequence
from typing import Any

from opd_jax.config.check import metric_problem

Scorer = Callable[[str, str, str], float]

_BOXED = "\\boxed{"


def final_answer(completion: str) -> str:
  """The final answer of a completion (module docstring: boxed, then ####, then last line)."""
  start = completion.rfind(_BOXED)
  if start >= 0:
    depth, i = 1, start + len(_BOXED)
    for j in range(i, len(completion)):
      depth += {"{": 1, "}": -1}.get(completion[j], 0)
      if depth == 0:
        return completion[i:j].strip()
    return completion[i:].strip()  # unclosed: everything after the opening brace
  marker = completion.rfind("####")
  if marker >= 0:
    return completion[marker + 4 :].split("\n", 1)[0].strip()
  lines = [line for line in completion.splitlines() if line.strip()]
  return lines[-1].strip() if lines else ""


def exact_match(prompt: str, completion: str, answer: str) -> float:
  """1.0 if `final_answer(completion)` equals `answer.strip()`, else 0.0 (`prompt` unused)."""
  del prompt
  return float(final_answer(completion) == answer.strip())


def resolve(metric: str) -> Scorer | None:
  """The scorer `data.eval_metric` names: `exact_match`, None for "none", or the imported
  function of "package.module:function".

  Raises:
    ValueError: naming `metric` when its form is wrong, its module cannot be imported (the
      import error included), the module has no such attribute, or the attribute is not a
      function that accepts (prompt, completion, answer).
  """
  problem = metric_problem(metric)
  if problem:
    raise ValueError(f"data.eval_metric {problem}")
  if metric == "none":
    return None
  if metric == "exact_match":
    return exact_match
  module_name, name = metric.split(":")
  where = f"data.eval_metric={metric!r}"
  try:
    module = importlib.import_module(module_name)
  except Exception as e:  # ImportError, or whatever the module raises while it runs
    raise ValueError(
      f"{where}: cannot import module {module_name!r} ({type(e).__name__}: {e})"
    ) from e
  fn = getattr(module, name, None)
  if fn is None:
    raise ValueError(f"{where}: module {module_name!r} has no attribute {name!r}")
  if not callable(fn):
    raise ValueError(f"{where}: {name!r} is a {type(fn).__name__}, not a function")
  try:
    inspect.signature(fn).bind("prompt", "completion", "answer")
  except TypeError as e:
    raise ValueError(
      f"{where}: {name} must accept (prompt, completion, answer) as positional arguments ({e})"
    ) from e
  except ValueError:  # no signature to inspect (some builtins): call it and see
    pass
  return fn


def answer_of(record: dict[str, Any]) -> str | None:
  """A record's "answer" as a string (a JSON number as its text), or None when it has none.

  Raises:
    ValueError: an "answer" that is not a string or a number.
  """
  answer = record.get("answer")
  if answer is None or isinstance(answer, str):
    return answer
  if isinstance(answer, int | float) and not isinstance(answer, bool):
    return str(answer)
  raise ValueError(f'its "answer" is not a string or a number: {answer!r:.80}')


def answers(records: Sequence[dict[str, Any]], name: str) -> list[str | None]:
  """Record i's `answer_of`, None where it has none.

  Raises:
    ValueError: an "answer" that is not a string or a number, naming the record.
  """
  out = []
  for i, record in enumerate(records):
    try:
      out.append(answer_of(record))
    except ValueError as e:
      raise ValueError(f"record {i} of {name}: {e}") from e
  return out


def score(scorer: Scorer, prompt: str, completion: str, answer: str, where: str) -> float:
  """float(scorer(prompt, completion, answer)), with `where` (the record) named when it fails.

  Raises:
    ValueError: the scorer raised, or returned something that is not a number.
  """
  try:
    value = scorer(prompt, completion, answer)
    return float(value)
  except Exception as e:
    name = getattr(scorer, "__name__", repr(scorer))
    raise ValueError(f"scorer {name} failed on {where}: {type(e).__name__}: {e}") from e
