"""Held-out quality: per-token KL to the teacher, and a score of the completions.

Quality is measured on greedy decodes of held-out prompts, so it is deterministic
for given weights. What is held out (`plan`, from `preflight.check`):

    the built-in task      its "heldout" split (data.eval_size problems), when the task is
                           what the run trains on
    data.eval_file         a JSONL file of {"prompt"} or {"messages"} records, optionally with
                           an "answer"
    data.prompt_file only  `heldout_split`: data.eval_size records of the prompt file, chosen
                           by seed and left out of training
    train.eval_every = 0   nothing: no evaluation, no greedy decodes

The metrics:

    quality/student_teacher_kl = mean over completion tokens of KL(π_θ ‖ π_T) at the
                                 prefixes the student's greedy decode visits, with
                                 the student at T = 1 (the model itself). Always.
    quality/student_teacher_kl_at_rollout_t = the same KL with π_θ under the training
                                 rollouts' transform (temperature T, top-k, top-p, as
                                 `distribution.process_logits` applies them to the
                                 student's own logits) and π_T at `teacher.temperature`
                                 τ_T: the quantity the OPD loss trains. Reported when
                                 `evaluate` gets the training `SamplerConfig`; equal to
                                 the T = 1 value for greedy training rollouts, whose
                                 losses score T = 1, when τ_T = 1.
    quality/<who>_accuracy     = mean_b 1[y_b ends with eos and task.score(prompt_b,
                                 decode(y_b))]: the built-in task's exact match (a
                                 completion cut off by the token budget is wrong),
                                 who = student | teacher, and
                                 quality/relative_accuracy = student / teacher.
    quality/student_<metric>_t1 = the same score of one sample per prompt from π_θ at
                                 T = 1, unfiltered (the model itself), with a fixed key, so
                                 every evaluation of a run draws with the same noise; with
                                 `train.eval_sampled` (`evaluate`'s `sampled_seed`).
    quality/<who>_score        = the user's held-out set: the mean over records with an
                                 "answer" of scorer(prompt, decode(y), answer), the scorer
                                 `data.eval_metric` names (`opd_jax.data.scoring`: exact_match,
                                 or "package.module:function"), and quality/relative_score.
                                 Absent when no record has an answer or the metric is none.

The teacher is at T = 1, unfiltered (at τ_T only in quality/student_teacher_kl_at_rollout_t,
above). A user's set is decoded `data.batch_size` rows at a
time (`EvalSet.chunk`), so its logits never take more memory than a training batch's; the KL
is pooled over the chunks' tokens. The built-in task's set is decoded in one batch.

On a mesh (the params' own, `sharding.params_mesh`), the evaluation is sharded like the
training rollouts: every process holds the held-out token ids, each data·fsdp shard
decodes only its rows (`sampler.sample(..., mesh=)`), the teacher-forced forwards keep
the batch split (`completion_logits`), and each process decodes and scores only the
texts of the rows its devices hold; the scores are summed across shards on device.
Padding rows (a chunk rounded up to a multiple of data·fsdp) have mask 0 and
are not counted.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from opd_jax.config.spec import RunSpec
from opd_jax.data import prompts as prompts_lib
from opd_jax.data import rewards, scoring, task
from opd_jax.inference import distribution, sampler, teacher_forcing
from opd_jax.model import sharding
from opd_jax.model.config import ModelConfig
from opd_jax.train import losses

Scorer = scoring.Scorer


def _task_scorer(prompt: str, completion: str, answer: str | None) -> float:
  """The built-in task's exact match (`task.score`; the answer is implied by the prompt)."""
  del answer
  return float(task.score(prompt, completion))


@dataclasses.dataclass
class EvalSet:
  """Held-out prompts, encoded once, and how their completions are scored.

  Rows are scored by `scorer(prompts[i], completion_i, answers[i])`: every row when `answers`
  is None (the built-in task), else the rows whose answer is not None. With `requires_eos`
  (`make_eval_set`: the built-in task, whose answer is the text before its eos) a completion
  the token budget cut off scores 0 (`rewards.finished_rows`); without it (a user's scorer)
  the text is read as written. The score's metrics
  are quality/student_<metric>, quality/teacher_<metric> and quality/relative_<metric>;
  with no scorer (or no row to score) there are none, and the KL is the whole evaluation.
  """

  prompts: list[str]  # the prompts' texts, as scored and shown in the text log
  tokens_bp: np.ndarray  # int32 [N, P], right-padded
  lens_b: np.ndarray  # int32 [N]
  answers: list[str | None] | None = None  # None: every row scored (the built-in task)
  scorer: Scorer | None = _task_scorer
  metric: str = "accuracy"
  chunk: int = 0  # rows decoded at once (a fixed compiled shape and memory); 0 = all
  name: str = "the built-in task"
  requires_eos: bool = False  # a completion without its eos scores 0 (`make_eval_set`)

  def __len__(self) -> int:
    return len(self.prompts)

  @property
  def scored(self) -> list[int]:
    """The rows `scorer` scores."""
    if self.scorer is None:
      return []
    if self.answers is None:
      return list(range(len(self)))
    return [i for i, a in enumerate(self.answers) if a is not None]

  def rows(self, start: int, stop: int) -> EvalSet:
    """Rows [start, stop) as an EvalSet of their own (same width)."""
    answers = None if self.answers is None else self.answers[start:stop]
    return dataclasses.replace(
      self,
      prompts=self.prompts[start:stop],
      tokens_bp=self.tokens_bp[start:stop],
      lens_b=self.lens_b[start:stop],
      answers=answers,
    )


def make_eval_set(source, tokenizer, prompt_len: int) -> EvalSet:
  """The built-in task's held-out set from a random-access `source` of {"prompt": ...} dicts,
  scored by exact match (`task.score`, and no answer without the eos: `requires_eos`) as
  quality/*_accuracy, decoded in one batch."""
  prompts = [source[i]["prompt"] for i in range(len(source))]
  tokens_bp, lens_b = task.encode_prompts(prompts, tokenizer, prompt_len)
  return EvalSet(prompts, tokens_bp, lens_b, requires_eos=True)


def make_prompt_eval_set(
  prompt_set: prompts_lib.PromptSet, tokenizer, scorer: Scorer | None, chunk: int
) -> EvalSet:
  """A held-out set of the user's prepared prompts (`prompts.PromptSet`): their token ids as
  prepared (chat template, length policy), their texts, and their "answer" fields, scored by
  `scorer` as quality/*_score (None, or no record with an answer: the KL alone).

  Args:
    prompt_set: the held-out prompts (`plan`'s second value).
    tokenizer: the run's tokenizer (its pad id fills the rows).
    scorer: from `scoring.resolve(data.eval_metric)`.
    chunk: rows decoded at once (`data.batch_size`: a memory the train step already needs).
  """
  records = prompt_set.records
  answers = scoring.answers(records, prompt_set.name)
  if all(a is None for a in answers):
    scorer = None
  ids = [r["prompt"] for r in records]
  tokens_bp, lens_b = task.encode_prompts(ids, tokenizer, prompt_set.width)
  texts = [r["text"] for r in records]
  return EvalSet(texts, tokens_bp, lens_b, answers, scorer, "score", chunk, prompt_set.name)


def heldout_size(n: int, eval_size: int) -> int:
  """How many of a prompt file's n records `heldout_split` holds out: data.eval_size, but
  never more than half the file, so that a small file still trains on most of its prompts:

      size = min(eval_size, ⌊n / 2⌋)

  Raises:
    ValueError: a file of one prompt, which cannot be split.
  """
  if n < 2:
    raise ValueError(
      f"a prompt file of {n} prompt cannot spare a held-out slice for evaluation; give a "
      "separate data.eval_file, or turn evaluation off with train.eval_every=0"
    )
  return min(eval_size, n // 2)


def heldout_split(
  prompt_set: prompts_lib.PromptSet, eval_size: int, seed: int
) -> tuple[prompts_lib.PromptSet, prompts_lib.PromptSet]:
  """(training, held-out) records of a prompt file: `heldout_size(N, eval_size)` records,
  the first entries of `np.random.default_rng(seed).permutation(N)`, are held out and the rest
  train; both keep the file's order. Deterministic for a given file, length policy and seed;
  the held-out records are never trained on. The split is by record: a prompt that appears
  twice in the file can fall on both sides, so deduplicate a file whose held-out score should
  be on unseen prompts. A training set smaller than a batch is drawn with repeats
  (`data.prompt_batches` cycles over epochs).

  Raises:
    ValueError: a file of one prompt (`heldout_size`).
  """
  n = len(prompt_set)
  try:
    size = heldout_size(n, eval_size)
  except ValueError as e:
    raise ValueError(f"{prompt_set.name}: {e}") from e
  order = np.random.default_rng(seed).permutation(n)
  held, kept = np.sort(order[:size]), np.sort(order[size:])

  def subset(index, name, dropped, truncated):
    return dataclasses.replace(
      prompt_set,
      name=name,
      records=[prompt_set.records[i] for i in index],
      lengths=prompt_set.lengths[index],
      dropped=dropped,
      truncated=truncated,
    )

  train = subset(kept, prompt_set.name, prompt_set.dropped, prompt_set.truncated)
  return train, subset(held, f"{prompt_set.name} (held out)", [], 0)


def plan(spec: RunSpec, train_prompts, eval_prompts, log=print):
  """Which prompts a run trains and evaluates on: (training prompts, held-out prompts).

    train.eval_every = 0         (train_prompts, None): no evaluation
    data.eval_file given         (train_prompts, eval_prompts)
    data.prompt_file only        `heldout_split(train_prompts, data.eval_size, seed)`: a
                                 slice of the file (at most half), not trained on
    neither (the built-in task)  (None, None): the trainer evaluates the task's held-out split

  The held-out records' answers are checked here (`scoring.answers`), so a bad one fails
  before any weights load.

  Args:
    spec: the run's spec.
    train_prompts, eval_prompts: `prompts.PromptSet`s of data.prompt_file and
      data.eval_file, or None where the config names none.
    log: where the choice is reported.
  """
  if not spec.train.eval_every:
    log("evaluation off (train.eval_every=0)")
    return train_prompts, None
  if eval_prompts is None and train_prompts is None:
    return None, None
  d = spec.data
  if eval_prompts is None:
    train_prompts, eval_prompts = heldout_split(train_prompts, d.eval_size, spec.seed)
    capped = "" if len(eval_prompts) == d.eval_size else ", capped at half the file"
    log(
      f"evaluation: {len(eval_prompts)} prompts of {train_prompts.name} held out "
      f"(data.eval_size={d.eval_size}{capped}; seed {spec.seed}), {len(train_prompts)} left "
      "for training"
    )
  answered = sum(a is not None for a in scoring.answers(eval_prompts.records, eval_prompts.name))
  scored = f"scored by {d.eval_metric}" if answered and d.eval_metric != "none" else "not scored"
  log(
    f"evaluation: KL(student||teacher) on {len(eval_prompts)} prompts of {eval_prompts.name}; "
    f"{answered} carry an answer ({scored})"
  )
  return train_prompts, eval_prompts


def takes_heldout_slice(spec: RunSpec) -> bool:
  """Whether `plan` holds a slice of the prompt file out of training under `spec`."""
  d = spec.data
  return bool(d.prompt_file and not d.eval_file and spec.train.eval_every)


def check_resumed_slice(saved: bool | None, spec: RunSpec) -> None:
  """Refuses to resume checkpoints trained with(out) a held-out slice of the prompt file
  (`takes_heldout_slice`, stored as `saved`; None: checkpoints that predate it) under a config
  that would change it, as turning evaluation on or off or adding or removing data.eval_file
  does: the training records, and so the data position the checkpoint stores, would differ.

  Raises:
    ValueError: naming both settings and what to do.
  """
  now = takes_heldout_slice(spec)
  if saved is None or bool(saved) == now:
    return
  how = {True: "with", False: "without"}
  raise ValueError(
    f"the checkpoints were trained {how[bool(saved)]} a held-out slice of data.prompt_file, "
    f"and this config would train {how[now]} one (train.eval_every="
    f"{spec.train.eval_every}, data.eval_file={spec.data.eval_file!r}); the training "
    "records would differ. Resume with the evaluation settings the run started with, or use a "
    "new --workdir"
  )


def greedy_rollout(
  params, cfg: ModelConfig, eval_set: EvalSet, max_new_tokens: int, eos_id: int, mesh=None
):
  """Greedy completions of every held-out prompt (a `Rollout`; batch-split on `mesh`)."""
  scfg = sampler.SamplerConfig(
    max_new_tokens=max_new_tokens, temperature=0.0, stop_tokens=(eos_id,)
  )
  prompts = (eval_set.tokens_bp, eval_set.lens_b)
  return sampler.sample(params, prompts, jax.random.key(0), scfg, cfg, mesh=mesh)


def sampled_rollout(
  params, cfg: ModelConfig, eval_set: EvalSet, max_new_tokens: int, eos_id: int, key, mesh=None
):
  """One completion of every held-out prompt sampled from π_θ at T = 1 with no top-k or top-p
  (a `Rollout`; batch-split on `mesh`), drawn with `key`."""
  scfg = sampler.SamplerConfig(
    max_new_tokens=max_new_tokens, temperature=1.0, stop_tokens=(eos_id,)
  )
  prompts = (eval_set.tokens_bp, eval_set.lens_b)
  return sampler.sample(params, prompts, key, scfg, cfg, mesh=mesh)


def score_rollout(rollout, eval_set: EvalSet, tokenizer) -> tuple[float, list[str]]:
  """The sum of the scores of a rollout's completions over `eval_set.scored`, and the texts.

  Rows beyond the held-out set (a sharded rollout's padding) are not counted; with
  `eval_set.requires_eos` a row without its eos scores 0. Each
  process decodes and scores only the rows its devices hold, and the scores are summed on
  device, so every row counts once; texts of rows held by other processes are "".
  """
  n = len(eval_set)
  texts = [""] * n
  scored = set(eval_set.scored)

  def scores(start, tokens_bc, mask_bc):
    out = np.zeros(len(tokens_bc), np.float32)
    finished_b = rewards.finished_rows(tokens_bc, mask_bc, tokenizer.eos_id)
    for i, (row, m) in enumerate(zip(tokens_bc, mask_bc, strict=True), start):
      if i < n:
        texts[i] = tokenizer.decode(row[m > 0].tolist())
        if eval_set.requires_eos and not finished_b[i - start]:
          continue  # cut off by the token budget: no answer (0)
        if i in scored:
          answer = None if eval_set.answers is None else eval_set.answers[i]
          where = f"held-out prompt {i} of {eval_set.name}"
          out[i - start] = scoring.score(
            eval_set.scorer, eval_set.prompts[i], texts[i], answer, where
          )
    return out

  scores_b = sharding.map_local_rows(scores, rollout.completion_tokens, rollout.completion_mask)
  return float(jnp.sum(scores_b)), texts


def accuracy(rollout, eval_set: EvalSet, tokenizer) -> tuple[float, list[str]]:
  """The mean score of a rollout's completions over the scored rows (exact-match accuracy
  for the built-in task), and the decoded texts (`score_rollout`)."""
  total, texts = score_rollout(rollout, eval_set, tokenizer)
  return total / max(len(eval_set.scored), 1), texts


@jax.jit
def _masked_kl(student_bcv, teacher_bcv, mask_bc):
  return losses.masked_mean(losses.per_token_kl(student_bcv, teacher_bcv), mask_bc)


@functools.partial(jax.jit, static_argnames=("sampling", "mesh"))
def _masked_kl_transformed(student_bcv, teacher_bcv, mask_bc, sampling, mesh=None):
  b, c, v = student_bcv.shape
  z_bv = distribution.process_logits(student_bcv.reshape(b * c, v), sampling, mesh)
  z_bcv = z_bv.reshape(b, c, v)
  return losses.masked_mean(losses.per_token_kl(z_bcv, teacher_bcv), mask_bc)


def student_teacher_kl(
  student_params,
  student_cfg,
  teacher_params,
  teacher_cfg,
  rollout,
  sampling=None,
  teacher_temperature: float = 1.0,
) -> float:
  """Mean per-token KL(π_θ ‖ π_T) over the rollout's completion tokens.

  Args:
    student_params, student_cfg, teacher_params, teacher_cfg: the two models.
    rollout: the completions whose prefixes are scored.
    sampling: None scores both models at T = 1; a `sampler.SamplerConfig` scores what the
      loss trains instead: with temperature > 0, π_θ = softmax(process_logits(logits,
      sampling)) (its temperature, top-k and top-p on the student's own logits), and the
      teacher at `teacher_temperature` τ_T, π_T = softmax(z_T / τ_T).
    teacher_temperature: τ_T (`teacher.temperature`); used only with `sampling`.

  Returns:
    The mean KL as a float.
  """
  mesh = sharding.params_mesh(student_params)
  s_bcv, mask_bc = teacher_forcing.sharded_completion_logits(
    student_params, rollout, student_cfg, mesh
  )
  t_bcv, _ = teacher_forcing.sharded_completion_logits(teacher_params, rollout, teacher_cfg, mesh)
  if sampling is not None and teacher_temperature != 1.0:
    t_bcv = t_bcv / teacher_temperature
  if sampling is None or sampling.temperature == 0:
    return float(_masked_kl(s_bcv, t_bcv, mask_bc))
  return float(_masked_kl_transformed(s_bcv, t_bcv, mask_bc, sampling, mesh))


def _kl_sum(mean: float, rollout) -> tuple[float, float]:
  """(mean x tokens, tokens) of a chunk's masked-mean KL, to pool chunks token-weighted."""
  tokens = float(jnp.sum(rollout.completion_mask))
  return mean * tokens, tokens


def evaluate(
  student_params,
  student_cfg,
  teacher_params,
  teacher_cfg,
  eval_set: EvalSet,
  tokenizer,
  max_new_tokens: int,
  teacher_score: float | None = None,
  train_sampling: sampler.SamplerConfig | None = None,
  teacher_temperature: float = 1.0,
  sampled_seed: int | None = None,
):
  """quality/* metrics of the student (and the teacher's score when not given).

  The set is decoded `eval_set.chunk` rows at a time (all at once when 0); the KL is pooled
  over every completion token of every chunk, the score over every scored row:

      quality/student_teacher_kl = Σ_chunks KL_c · n_c / Σ_chunks n_c   (n_c: tokens of c)
      quality/student_<metric>   = Σ_scored rows score_i / |scored rows|
      quality/student_<metric>_t1 = the same over one T = 1 sample per prompt (`sampled_seed`
                                   not None: chunk c drawn with fold_in(key(seed), c's start))

  `train_sampling`, the training rollouts' `SamplerConfig`, adds
  `quality/student_teacher_kl_at_rollout_t` (see the module docstring), with the teacher at
  `teacher_temperature` (`teacher.temperature`) as the loss scores it. The teacher is
  decoded only when the set has scored rows and `teacher_score` is None (it is frozen, so
  the caller keeps its first score).

  Returns:
    (metrics dict, up to four "prompt + completion" student samples for the text log; a
    record's answer is appended as " [answer: ...]").
  """
  mesh = sharding.params_mesh(student_params)
  n, chunk = len(eval_set), eval_set.chunk or len(eval_set)
  scored = len(eval_set.scored)
  score_teacher = scored and teacher_score is None
  kl, kl_t, tokens, total, teacher_total, texts = 0.0, 0.0, 0.0, 0.0, 0.0, []
  sampled_total = 0.0
  for start in range(0, n, chunk):
    part = eval_set.rows(start, min(start + chunk, n))
    rollout = greedy_rollout(
      student_params, student_cfg, part, max_new_tokens, tokenizer.eos_id, mesh
    )
    part_total, part_texts = score_rollout(rollout, part, tokenizer)
    total, texts = total + part_total, texts + part_texts
    if sampled_seed is not None and scored:
      key = jax.random.fold_in(jax.random.key(sampled_seed), start)
      s_rollout = sampled_rollout(
        student_params, student_cfg, part, max_new_tokens, tokenizer.eos_id, key, mesh
      )
      sampled_total += score_rollout(s_rollout, part, tokenizer)[0]
    mean = student_teacher_kl(student_params, student_cfg, teacher_params, teacher_cfg, rollout)
    kl_sum, part_tokens = _kl_sum(mean, rollout)
    kl, tokens = kl + kl_sum, tokens + part_tokens
    if train_sampling is not None:
      mean_t = student_teacher_kl(
        student_params,
        student_cfg,
        teacher_params,
        teacher_cfg,
        rollout,
        train_sampling,
        teacher_temperature,
      )
      kl_t += _kl_sum(mean_t, rollout)[0]
    if score_teacher:
      t_rollout = greedy_rollout(
        teacher_params, teacher_cfg, part, max_new_tokens, tokenizer.eos_id, mesh
      )
      teacher_total += score_rollout(t_rollout, part, tokenizer)[0]
  tokens = max(tokens, 1.0)
  metrics = {}
  name = eval_set.metric
  if scored:
    metrics[f"quality/student_{name}"] = total / scored
    if sampled_seed is not None:
      metrics[f"quality/student_{name}_t1"] = sampled_total / scored
  metrics["quality/student_teacher_kl"] = kl / tokens
  if train_sampling is not None:
    metrics["quality/student_teacher_kl_at_rollout_t"] = kl_t / tokens
  if scored:
    if teacher_score is None:
      teacher_score = teacher_total / scored
    metrics[f"quality/teacher_{name}"] = teacher_score
    metrics[f"quality/relative_{name}"] = metrics[f"quality/student_{name}"] / max(
      teacher_score, 1e-9
    )
  samples = []
  for i in range(min(4, n)):
    answer = None if eval_set.answers is None else eval_set.answers[i]
    suffix = "" if answer is None else f" [answer: {answer}]"
    samples.append(f"{eval_set.prompts[i]}{texts[i]}{suffix}")
  return metrics, samples


def summary(metrics: dict[str, float], metric: str, teacher: bool = True) -> str:
  """One log line of what an evaluation measured, e.g. "teacher accuracy 0.950, student
  accuracy 0.400, KL(student||teacher) 0.1234" (without the score when there is none)."""
  parts = []
  for who in ("teacher", "student") if teacher else ("student",):
    key = f"quality/{who}_{metric}"
    if key in metrics:
      parts.append(f"{who} {metric} {metrics[key]:.3f}")
  parts.append(f"KL(student||teacher) {metrics['quality/student_teacher_kl']:.4f}")
  return ", ".join(parts)


def before_after(initial: dict[str, float], final: dict[str, float], metric: str) -> dict:
  """A run's summary fields of its first and last evaluations: teacher_<metric>,
  student_<metric>_before/_after (when scored) and student_teacher_kl_before/_after."""
  out = {}
  if f"quality/student_{metric}" in initial:
    out[f"teacher_{metric}"] = initial[f"quality/teacher_{metric}"]
    out[f"student_{metric}_before"] = initial[f"quality/student_{metric}"]
    out[f"student_{metric}_after"] = final[f"quality/student_{metric}"]
  out["student_teacher_kl_before"] = initial["quality/student_teacher_kl"]
  out["student_teacher_kl_after"] = final["quality/student_teacher_kl"]
  return out
