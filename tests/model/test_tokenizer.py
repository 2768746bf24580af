"""Tokenizer interface: character tokenizer, offline Hugging Face tokenizer, vocab check."""

import pytest

from opd_jax.model import tokenizer as tk


def test_char_round_trip_and_special_ids():
  tok = tk.CharTokenizer()
  assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
  assert tok.vocab_size == 3 + len(tk.CHAR_ALPHABET)
  text = "37+58=95;95+21=116>116 1-2*3:4"
  ids = tok.encode(text)
  assert len(ids) == len(text)
  assert min(ids) >= 3 and max(ids) < tok.vocab_size
  assert tok.decode(ids) == text
  assert tok.encode("0") == [3]


def test_char_decode_stops_at_eos_and_skips_pad_and_bos():
  tok = tk.CharTokenizer()
  ids = [tok.bos_id] + tok.encode("12") + [tok.pad_id] + tok.encode("3") + [tok.eos_id]
  ids += tok.encode("99")
  assert tok.decode(ids) == "123"


def test_char_errors_name_the_problem():
  tok = tk.CharTokenizer()
  with pytest.raises(ValueError, match=r"'x' at position 3"):
    tok.encode("12+x")
  with pytest.raises(ValueError, match="token id 99"):
    tok.decode([3, 99])


def test_load_tokenizer_char_and_missing_dir(tmp_path):
  assert isinstance(tk.load_tokenizer("char"), tk.CharTokenizer)
  missing = tmp_path / "no_such_tokenizer"
  with pytest.raises(FileNotFoundError, match="no_such_tokenizer"):
    tk.load_tokenizer(str(missing))


def _save_word_level_tokenizer(path, words):
  """Trains a tiny WordLevel tokenizer in-process and saves it the transformers way."""
  from tokenizers import Tokenizer, models, pre_tokenizers, trainers
  from transformers import PreTrainedTokenizerFast

  raw = Tokenizer(models.WordLevel(unk_token="<unk>"))
  raw.pre_tokenizer = pre_tokenizers.Whitespace()
  trainer = trainers.WordLevelTrainer(special_tokens=["<pad>", "<bos>", "<eos>", "<unk>"])
  raw.train_from_iterator([" ".join(words)] * 3, trainer=trainer)
  fast = PreTrainedTokenizerFast(
    tokenizer_object=raw,
    pad_token="<pad>",
    bos_token="<bos>",
    eos_token="<eos>",
    unk_token="<unk>",
  )
  fast.save_pretrained(str(path))
  return fast


def test_hf_tokenizer_from_local_dir(tmp_path):
  words = ["alpha", "beta", "gamma", "delta"]
  fast = _save_word_level_tokenizer(tmp_path, words)
  tok = tk.load_tokenizer(str(tmp_path))
  assert isinstance(tok, tk.HFTokenizer)
  assert tok.vocab_size == len(fast) == 4 + len(words)
  assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
  ids = tok.encode("gamma alpha delta")
  assert ids == [fast.convert_tokens_to_ids(w) for w in ("gamma", "alpha", "delta")]
  assert tok.decode(ids + [tok.eos_id] + tok.encode("beta")) == "gamma alpha delta"
  assert tok.decode([tok.bos_id, tok.pad_id] + ids) == "gamma alpha delta"
  assert tok.get_vocab()["beta"] == fast.convert_tokens_to_ids("beta")


def test_check_same_vocab_sizes():
  tk.check_same_vocab(21, 21)
  with pytest.raises(ValueError, match=r"student vocab_size=21.*teacher vocab_size=32"):
    tk.check_same_vocab(21, 32)


def test_check_same_vocab_names_first_differing_token(tmp_path):
  a = tk.CharTokenizer("0123456789+=")
  b = tk.CharTokenizer("0123456789=+")
  tk.check_same_vocab(a.vocab_size, a.vocab_size, a, tk.CharTokenizer("0123456789+="))
  with pytest.raises(ValueError, match=r"id 13 is '\+' in the student and '=' in the teacher"):
    tk.check_same_vocab(a.vocab_size, b.vocab_size, a, b)

  _save_word_level_tokenizer(tmp_path, ["x"])
  hf = tk.load_tokenizer(str(tmp_path))
  with pytest.raises(ValueError, match=r"id 3 is '<unk>' in the student and '0' in the teacher"):
    tk.check_same_vocab(hf.vocab_size, a.vocab_size, hf, a)


def test_resolve_name_prefers_the_setting_then_the_student_checkpoint():
  assert tk.resolve_name("", "/ckpts/student") == "/ckpts/student"
  assert tk.resolve_name("", "") == "char"
  assert tk.resolve_name("char", "/ckpts/student") == "char"
  assert tk.resolve_name("/tok", "/ckpts/student") == "/tok"
  assert isinstance(tk.load_tokenizer(""), tk.CharTokenizer)


def test_directory_without_tokenizer_files_says_what_to_set(tmp_path):
  (tmp_path / "config.json").write_text("{}")
  with pytest.raises(
    ValueError, match=r"holds no tokenizer \(tokenizer.json, .*set config.tokenizer"
  ):
    tk.load_tokenizer(str(tmp_path))


def test_char_tokenizer_has_no_chat_template():
  with pytest.raises(ValueError, match="character tokenizer has no chat template"):
    tk.CharTokenizer().render_chat([{"role": "user", "content": "1+2="}])
