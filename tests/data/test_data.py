"""Tests for the prompt pipeline: determinism, shuffling, sharding, resume, JSONL validation."""

import functools
import itertools
import json

import numpy as np
import pytest

from opd_jax.data import pipeline as data
from opd_jax.data.task import TaskConfig, TaskSource, encode_example
from opd_jax.model.tokenizer import CharTokenizer


def _numbered(n):
  return [{"prompt": f"p{i}", "id": i} for i in range(n)]


def _ids(batches):
  return [list(b["id"]) for b in batches]


def _take(iterator, n):
  return list(itertools.islice(iterator, n))


def test_same_seed_same_batches_different_seed_different_batches():
  source = TaskSource("train", 16, seed=0)
  a = _take(iter(data.prompt_batches(source, 4, seed=7)), 6)
  b = _take(iter(data.prompt_batches(source, 4, seed=7)), 6)
  c = _take(iter(data.prompt_batches(source, 4, seed=8)), 6)
  assert a == b
  assert [x["prompt"] for x in a] != [x["prompt"] for x in c]
  assert set(a[0]) == {"prompt", "completion", "answer"}
  assert all(isinstance(p, str) for p in a[0]["prompt"]) and len(a[0]["prompt"]) == 4


def test_each_epoch_is_a_fresh_permutation():
  n = 20
  batches = list(data.prompt_batches(_numbered(n), 5, seed=3, num_epochs=2))
  order = [i for b in batches for i in b["id"]]
  epoch0, epoch1 = order[:n], order[n:]
  assert len(batches) == 8
  assert sorted(epoch0) == list(range(n)) and sorted(epoch1) == list(range(n))
  assert epoch0 != list(range(n))  # shuffled
  assert epoch0 != epoch1  # reshuffled per epoch
  assert isinstance(batches[0]["id"], np.ndarray) and batches[0]["id"].shape == (5,)


@pytest.mark.parametrize("shard_count", [2, 3])
def test_shards_are_disjoint_and_cover_each_epoch(shard_count):
  n = 10
  per_shard = []
  for shard in range(shard_count):
    batches = data.prompt_batches(
      _numbered(n), 1, seed=5, num_epochs=1, shard_index=shard, shard_count=shard_count
    )
    per_shard.append([int(b["id"][0]) for b in batches])
  assert sorted(len(s) for s in per_shard) == sorted(
    len(range(i, n, shard_count)) for i in range(shard_count)
  )
  flat = [i for s in per_shard for i in s]
  assert sorted(flat) == list(range(n))  # disjoint (no duplicates) and covering


def test_resume_from_saved_state_matches_uninterrupted_run():
  source = _numbered(7)
  make = lambda: iter(data.prompt_batches(source, 3, seed=11, shard_index=1, shard_count=2))
  uninterrupted = _ids(_take(make(), 9))  # 27 elements: crosses several 3-element epochs

  first = make()
  _take(first, 4)
  saved = data.state_to_json(first.get_state())
  assert isinstance(saved, bytes)
  json.loads(saved)  # plain JSON, storable in a checkpoint
  resumed = make()
  resumed.set_state(data.state_from_json(saved))
  assert _ids(_take(resumed, 5)) == uninterrupted[4:]
  # The original keeps going identically too: saving the state does not disturb it.
  assert _ids(_take(first, 5)) == uninterrupted[4:]


def test_encode_fn_output_is_stacked():
  tok = CharTokenizer()
  config = TaskConfig()
  encode = functools.partial(encode_example, tokenizer=tok, seq_len=config.seq_len)
  source = TaskSource("train", 8, seed=0)
  batch = next(iter(data.prompt_batches(source, 4, seed=0, encode_fn=encode)))
  assert batch["tokens"].shape == (4, config.seq_len) and batch["tokens"].dtype == np.int32
  assert batch["prompt_len"].tolist() == [config.max_prompt_tokens] * 4
  plain = next(iter(data.prompt_batches(source, 4, seed=0)))
  pairs = zip(plain["prompt"], plain["completion"], strict=True)
  expected = np.stack([encode({"prompt": p, "completion": c})["tokens"] for p, c in pairs])
  np.testing.assert_array_equal(batch["tokens"], expected)


def test_collate_ragged_and_missing_fields():
  batch = data.collate([{"prompt": "a", "ids": [1, 2], "answer": "x"}, {"prompt": "b", "ids": [3]}])
  assert batch == {"prompt": ["a", "b"], "ids": [[1, 2], [3]], "answer": ["x", None]}
  stacked = data.collate([{"n": 1}, {"n": 2}])["n"]
  assert stacked.tolist() == [1, 2]
  # A ragged nested list (numpy refuses it) stays a plain list too.
  nested = [{"steps": [[1, 2], [3]]}, {"steps": [[4], [5, 6]]}]
  assert data.collate(nested) == {"steps": [[[1, 2], [3]], [[4], [5, 6]]]}


def test_bad_arguments_raise():
  with pytest.raises(ValueError, match="batch_size"):
    data.prompt_batches(_numbered(4), 0, seed=0)
  with pytest.raises(ValueError, match="shard_index"):
    data.prompt_batches(_numbered(4), 1, seed=0, shard_index=2, shard_count=2)
  with pytest.raises(ValueError, match="cannot be split over 5 shards"):
    data.prompt_batches(_numbered(4), 1, seed=0, shard_count=5)
  with pytest.raises(ValueError, match="fewer than one batch of 5"):
    data.prompt_batches(_numbered(4), 5, seed=0, num_epochs=1)


def test_jsonl_source_keeps_fields_and_skips_blank_lines(tmp_path):
  path = tmp_path / "prompts.jsonl"
  path.write_text('{"prompt": "1+2=", "answer": "3"}\n\n{"prompt": "4+5="}\n')
  source = data.JsonlSource(path)
  assert len(source) == 2
  assert source[0] == {"prompt": "1+2=", "answer": "3"}
  assert source[1] == {"prompt": "4+5="}
  assert source.line_numbers == [1, 3]  # blank lines are skipped, not renumbered
  batch = next(iter(data.prompt_batches(source, 2, seed=0)))
  assert sorted(batch["prompt"]) == ["1+2=", "4+5="]


def test_jsonl_source_errors(tmp_path):
  missing = tmp_path / "nope.jsonl"
  with pytest.raises(FileNotFoundError, match="nope.jsonl"):
    data.JsonlSource(missing)

  empty = tmp_path / "empty.jsonl"
  empty.write_text("\n  \n")
  with pytest.raises(ValueError, match=r"prompt file .*empty.jsonl is empty"):
    data.JsonlSource(empty)

  bad = tmp_path / "bad.jsonl"
  bad.write_text('{"prompt": "a"}\n{"prompt": "b",}\n')
  with pytest.raises(ValueError, match=r"bad.jsonl line 2 is not valid JSON: .*line 1 column 16"):
    data.JsonlSource(bad)

  no_prompt = tmp_path / "no_prompt.jsonl"
  no_prompt.write_text('{"prompt": "a"}\n{"prompt": "b"}\n{"question": "c"}\n')
  with pytest.raises(
    ValueError,
    match=r'line 3 has no string "prompt" field and no "messages" list \(fields: \[.question.\]\)$',
  ):
    data.JsonlSource(no_prompt)

  not_string = tmp_path / "not_string.jsonl"
  not_string.write_text('{"prompt": 5}\n')
  with pytest.raises(ValueError, match='line 1 has no string "prompt"'):
    data.JsonlSource(not_string)

  not_object = tmp_path / "list.jsonl"
  not_object.write_text('["a"]\n')
  with pytest.raises(ValueError, match="line 1 must be a JSON object, got list"):
    data.JsonlSource(not_object)
