"""Another engine's samples of the check's calibration prompts: the prompts file this project
writes for the engine (`write_prompts` / `read_prompts`) and the completions the engine writes
back (`read_engine_samples`), in one of three shapes:

  vllm    vLLM's `RequestOutput` as JSON: {"request_id", "prompt_token_ids", "outputs": [
          {"token_ids": [...], "logprobs": [{"<token id>": {"logprob", "rank",
          "decoded_token"}, ...}, ...]}, ...]} (one dict per sampled token, holding the
          sampled token and any alternatives asked for with `SamplingParams(logprobs=n)`)
  sglang  SGLang's `/generate` output: {"meta_info": {"id", "output_token_logprobs":
          [[logprob, token_id, text], ...], "output_top_logprobs": [[[logprob, token_id,
          text], ...], ...]}} (alternatives optional)
  plain   {"prompt_id", "completion_token_ids": [...], "completion_logprobs": [...]}

One JSON value per line (JSONL), or one JSON array of them; a line may also be a list (SGLang's
batch output). Any record may carry "prompt_id" (else vLLM's "request_id" or SGLang's
"meta_info.id" is the id) and the settings it was sampled with, as "sampling_params": {
"temperature", "top_k", "top_p", "min_p"} or those keys at its top level.

Parsing checks the shape only: every sampled token has a finite log-probability ≤ 0, it agrees
with the same token's entry among the alternatives, and the alternatives of a position are a
sub-distribution (Σ exp ≤ 1, no −inf entry: a −inf alternative means a filter removed it, and
a sum over 1 means the log-probabilities do not come from one softmax). What the samples are
judged against (the exported prompts, the vocabulary, the temperature) is
`mismatch.engine_screen.check_samples`.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

FORMATS = ("auto", "vllm", "sglang", "plain")
PROMPTS_FORMAT = "opd_jax/engine_prompts/1"  # the "format" of every line `write_prompts` writes
SAMPLING_KEYS = ("temperature", "top_k", "top_p", "min_p")
# Σ exp(alternatives) may exceed 1 by this much (the engine's float rounding) before it is refused.
SUM_TOLERANCE = 1e-3
# |sampled token's log-prob − its own alternatives entry| above this is a contradiction.
AGREE_TOLERANCE = 1e-3
# A sampled token's log-prob above this (nats) is no log-probability.
MAX_LOGPROB = 1e-4


@dataclasses.dataclass(frozen=True)
class EngineCompletion:
  """One completion of one prompt, as the engine returned it.

  Attributes:
    prompt_id: the exported prompt it completes, or None when the record names none.
    prompt_token_ids: the prompt's token ids as the record gives them, or None.
    token_ids: int64 [n], the sampled tokens in order (the stop token included when the engine
      returned it).
    logprobs: float64 [n], log π_engine(token) of each sampled token.
    sampling: the settings the record declares (SAMPLING_KEYS that it has).
    where: "FILE:LINE" (and the output's index) for messages.
  """

  prompt_id: str | None
  prompt_token_ids: tuple[int, ...] | None
  token_ids: np.ndarray
  logprobs: np.ndarray
  sampling: dict[str, float]
  where: str


def write_prompts(path: str, prompts: Sequence[Mapping[str, Any]], sampling: Mapping) -> int:
  """Writes one JSON line per prompt: {"format": PROMPTS_FORMAT, "prompt_id", "prompt" (text),
  "prompt_token_ids", "sampling_params"} where "sampling_params" are the settings the engine
  must sample with (temperature, top_k 0 and top_p 1: no filter, max_tokens, stop_token_ids,
  logprobs 0: the sampled token's log-probability). Returns the number of lines."""
  with open(path, "w", encoding="utf-8") as f:
    for p in prompts:
      line = {
        "format": PROMPTS_FORMAT,
        "prompt_id": p["prompt_id"],
        "prompt": p["prompt"],
        "prompt_token_ids": [int(t) for t in p["prompt_token_ids"]],
        "sampling_params": dict(sampling),
      }
      f.write(json.dumps(line) + "\n")
  return len(prompts)


def read_prompts(path: str) -> list[dict]:
  """The lines `write_prompts` wrote, in order. Raises ValueError for another file."""
  out = []
  for where, value in _json_values(path):
    if not isinstance(value, dict) or value.get("format") != PROMPTS_FORMAT:
      raise ValueError(f"{where}: not a prompts file written by --export-prompts")
    out.append(value)
  return out


def _json_values(path: str) -> Iterator[tuple[str, Any]]:
  """("FILE:LINE", value) for each JSON line of `path`, or for each item of one JSON array."""
  with open(path, encoding="utf-8") as f:
    text = f.read()
  if not text.strip():
    raise ValueError(f"{path}: empty file")
  if text.lstrip().startswith("["):
    try:
      values = json.loads(text)
    except json.JSONDecodeError:
      values = None  # a JSONL file whose lines are arrays (SGLang's batch output)
    if values is not None:
      for i, value in enumerate(values):
        yield f"{path}: item {i}", value
      return
  # Split on "\n" alone: str.splitlines also splits on U+2028/U+2029/U+0085, which JSON
  # writers with ensure_ascii=False leave raw inside strings (a token's text).
  for i, line in enumerate(text.split("\n"), 1):
    line = line.removesuffix("\r")
    if not line.strip():
      continue
    try:
      yield f"{path}:{i}", json.loads(line)
    except json.JSONDecodeError as e:
      raise ValueError(f"{path}:{i}: not JSON ({e.msg})") from e


def detect_format(record: Mapping) -> str:
  """The shape of one record: "vllm", "sglang" or "plain" (ValueError naming what it lacks)."""
  if "outputs" in record:
    return "vllm"
  if "meta_info" in record:
    return "sglang"
  if "completion_token_ids" in record:
    return "plain"
  raise ValueError(
    "a record of none of the known shapes: vLLM's has 'outputs', SGLang's 'meta_info', the "
    f"plain one 'completion_token_ids' (keys found: {', '.join(sorted(record)) or 'none'})"
  )


def read_engine_samples(path: str, fmt: str = "auto") -> list[EngineCompletion]:
  """Every completion in `path`, in file order (the module docstring's shapes).

  Args:
    path: a JSONL file (or one JSON array) of engine outputs.
    fmt: one of FORMATS; "auto" reads each record's shape (`detect_format`).

  Raises:
    ValueError: an unknown format, a record of another shape, a completion with no tokens or
      missing log-probabilities, a non-finite or positive log-probability, a non-integer token
      id, or alternatives that are no sub-distribution (module docstring), naming the line.
  """
  if fmt not in FORMATS:
    raise ValueError(f"unknown engine format {fmt!r}; known: {', '.join(FORMATS)}")
  out = []
  for where, value in _json_values(path):
    for j, record in enumerate(value if isinstance(value, list) else [value]):
      here = where if not isinstance(value, list) else f"{where} [{j}]"
      if not isinstance(record, dict):
        raise ValueError(f"{here}: a record must be a JSON object, got {type(record).__name__}")
      shape = fmt
      try:
        shape = detect_format(record) if fmt == "auto" else fmt
        out.extend(_PARSERS[shape](record, here))
      except (KeyError, TypeError, IndexError, AttributeError) as e:
        raise ValueError(f"{here}: not a {shape} record ({type(e).__name__}: {e})") from e
      except ValueError as e:
        raise ValueError(e.args[0] if str(e).startswith(here) else f"{here}: {e}") from e
  if not out:
    raise ValueError(f"{path}: no completions")
  return out


def _sampling(record: Mapping) -> dict[str, float]:
  """The SAMPLING_KEYS a record declares, in "sampling_params" or at its top level."""
  found = {}
  params = record.get("sampling_params") or {}
  if not isinstance(params, Mapping):
    raise ValueError(f"'sampling_params' must be an object, got {type(params).__name__}")
  for source in (record, params):
    for key in SAMPLING_KEYS:
      if source.get(key) is not None:
        found[key] = float(source[key])
  return found


def _token_id(value, where: str) -> int:
  if isinstance(value, str) and value.lstrip("-").isdigit():
    value = int(value)
  if isinstance(value, bool) or not isinstance(value, int | np.integer):
    raise ValueError(f"{where}: token id {value!r} is not an integer")
  return int(value)


def _logprob(value, where: str) -> float:
  if isinstance(value, Mapping):
    value = value.get("logprob")
  if isinstance(value, list | tuple) and value:  # a serialized Logprob(logprob, rank, text)
    value = value[0]
  if value is None:
    raise ValueError(f"{where}: missing log-probability")
  if isinstance(value, bool) or not isinstance(value, int | float):
    raise ValueError(f"{where}: log-probability {value!r} is not a number")
  return float(value)


def _check_position(
  token: int, logprob: float, alternatives: dict[int, float] | None, where: str
) -> None:
  """The checks of one sampled position (module docstring)."""
  if not math.isfinite(logprob):
    raise ValueError(
      f"{where}: the sampled token's log-probability is {logprob}; a sampled token has a finite "
      "one (-inf: the engine filtered it, NaN: the engine's numerics broke)"
    )
  if logprob > MAX_LOGPROB:
    raise ValueError(f"{where}: log-probability {logprob} > 0 is no log-probability")
  if not alternatives:
    return
  if any(math.isnan(v) or v == math.inf for v in alternatives.values()):
    raise ValueError(f"{where}: an alternative's log-probability is NaN or +inf")
  if any(v == -math.inf for v in alternatives.values()):
    raise ValueError(
      f"{where}: an alternative has log-probability -inf: the engine filtered the distribution "
      "(top-k, top-p or min-p) and renormalised what it kept, so the log-probabilities are not "
      "those of the model's softmax; sample with top_k=0 (vLLM: -1), top_p=1, min_p=0"
    )
  total = math.fsum(math.exp(v) for v in alternatives.values())
  if total > 1 + SUM_TOLERANCE:
    raise ValueError(
      f"{where}: the alternatives' probabilities sum to {total:.6g} > 1: they were renormalised "
      "after a top-k/top-p filter or do not come from one distribution; sample with no filter "
      "and return the sampled distribution's log-probabilities"
    )
  if token in alternatives and abs(alternatives[token] - logprob) > AGREE_TOLERANCE:
    raise ValueError(
      f"{where}: the sampled token's log-probability {logprob:.6g} disagrees with its entry "
      f"{alternatives[token]:.6g} among the alternatives"
    )


def _completion(record, where, prompt_id, prompt_ids, tokens, logprobs, alternatives):
  if not tokens:
    raise ValueError(f"{where}: a completion with no tokens")
  if logprobs is None or len(logprobs) != len(tokens):
    got = "none" if logprobs is None else len(logprobs)
    raise ValueError(
      f"{where}: missing log-probabilities: {len(tokens)} tokens, {got} log-probabilities "
      "(vLLM: SamplingParams(logprobs=0); SGLang: return_logprob=True)"
    )
  for t, (token, lp) in enumerate(zip(tokens, logprobs, strict=True)):
    alt = alternatives[t] if alternatives else None
    _check_position(token, lp, alt, f"{where} token {t}")
  return EngineCompletion(
    prompt_id=None if prompt_id is None else str(prompt_id),
    prompt_token_ids=None if prompt_ids is None else tuple(_token_id(t, where) for t in prompt_ids),
    token_ids=np.asarray(tokens, np.int64),
    logprobs=np.asarray(logprobs, np.float64),
    sampling=_sampling(record),
    where=where,
  )


def _vllm(record: Mapping, where: str) -> list[EngineCompletion]:
  """vLLM RequestOutput: one completion per entry of "outputs"."""
  out = []
  prompt_id = record.get("prompt_id", record.get("request_id"))
  for i, output in enumerate(record["outputs"]):
    here = f"{where} output {i}"
    tokens = [_token_id(t, here) for t in output["token_ids"]]
    steps = output.get("logprobs")
    if steps is None:
      raise ValueError(
        f"{here}: missing log-probabilities ('logprobs' is null): request them with "
        "SamplingParams(logprobs=0)"
      )
    if len(steps) != len(tokens):
      raise ValueError(
        f"{here}: missing log-probabilities: {len(tokens)} tokens but {len(steps)} logprobs entries"
      )
    logprobs, alternatives = [], []
    for t, step in enumerate(steps):
      if not isinstance(step, Mapping):
        raise ValueError(f"{here} token {t}: logprobs entry is not a {{token_id: Logprob}} dict")
      alt = {_token_id(k, here): _logprob(v, f"{here} token {t}") for k, v in step.items()}
      if tokens[t] not in alt:
        raise ValueError(f"{here} token {t}: its logprobs dict has no entry for the sampled token")
      logprobs.append(alt[tokens[t]])
      alternatives.append(alt)
    out.append(
      _completion(
        record, here, prompt_id, record.get("prompt_token_ids"), tokens, logprobs, alternatives
      )
    )
  return out


def _sglang(record: Mapping, where: str) -> list[EngineCompletion]:
  """SGLang /generate output: meta_info.output_token_logprobs [[logprob, id, text], ...]."""
  meta = record["meta_info"]
  triples = meta.get("output_token_logprobs")
  if triples is None:
    raise ValueError(
      "missing log-probabilities: meta_info has no 'output_token_logprobs' (request with "
      "return_logprob=True)"
    )
  for i, triple in enumerate(triples):
    if not isinstance(triple, list | tuple) or len(triple) < 2:
      raise ValueError(
        f"token {i}: an output_token_logprobs entry must be [logprob, token_id, text], "
        f"got {triple!r}"
      )
  tokens = [_token_id(t[1], where) for t in triples]
  if record.get("output_ids") is not None and list(record["output_ids"]) != tokens:
    raise ValueError("output_ids and the token ids of output_token_logprobs differ")
  logprobs = [_logprob(t[0], f"{where} token {i}") for i, t in enumerate(triples)]
  tops = meta.get("output_top_logprobs")
  alternatives = None
  if tops:
    if len(tops) != len(tokens):
      raise ValueError(
        f"output_top_logprobs has {len(tops)} positions but the completion {len(tokens)} "
        "tokens: the alternatives cannot be matched to the tokens"
      )
    for i, top in enumerate(tops):
      for a in top or []:
        if not isinstance(a, list | tuple) or len(a) < 2:
          raise ValueError(
            f"token {i}: an output_top_logprobs entry must be [logprob, token_id, text], got {a!r}"
          )
    alternatives = [
      {_token_id(a[1], where): _logprob(a[0], f"{where} token {i}") for a in (top or [])}
      for i, top in enumerate(tops)
    ]
  prompt_id = record.get("prompt_id", meta.get("id"))
  return [
    _completion(
      record,
      where,
      prompt_id,
      record.get("prompt_token_ids", record.get("input_ids")),
      tokens,
      logprobs,
      alternatives,
    )
  ]


def _plain(record: Mapping, where: str) -> list[EngineCompletion]:
  """{"prompt_id", "completion_token_ids", "completion_logprobs"}."""
  tokens = [_token_id(t, where) for t in record["completion_token_ids"]]
  raw = record.get("completion_logprobs")
  logprobs = None
  if raw is not None:
    logprobs = [_logprob(v, f"{where} token {i}") for i, v in enumerate(raw)]
  return [
    _completion(
      record, where, record.get("prompt_id"), record.get("prompt_token_ids"), tokens, logprobs, None
    )
  ]


_PARSERS = {"vllm": _vllm, "sglang": _sglang, "plain": _plain}


def write_plain(path: str, completions: Sequence[Mapping[str, Any]]) -> None:
  """Writes completions in the plain shape, one JSON line each (keys as given: "prompt_id",
  "completion_token_ids", "completion_logprobs", and optionally "temperature" etc.)."""
  with open(path, "w", encoding="utf-8") as f:
    for c in completions:
      f.write(json.dumps(dict(c)) + "\n")
