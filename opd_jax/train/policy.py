"""The student's policy π_θ scored on a rollout under the rollout's own sampling transform.

One place (`student_policy_logits`) divides the student's logits by the rollout's temperature
and restricts them to the engine's kept set (`Rollout.support_ids`) when the sampler filtered
with top-k/top-p. The losses, the importance ratio, GRPO's reference student
(`reference_logprobs`) and the `mismatch/*` metrics (`opd_jax.mismatch`) all see that same π_θ,
so an engine identical to the trainer gives ratio 1 and zero mismatch under every sampling
setting (docs/design.md, "Data flow from prompt to loss").
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from opd_jax.data.rollout_types import Rollout
from opd_jax.inference import teacher_forcing
from opd_jax.train import losses


def support_mask(rollout: Rollout, vocab_size: int):
  """bool [B, C, V]: True on the engine's kept set K_b, from `rollout.support_ids`.

  Returns None when the rollout carries no kept set (the sampler did not filter).
  """
  ids_bcm = rollout.support_ids
  if ids_bcm is None:
    return None
  b, c, m = ids_bcm.shape
  if m == vocab_size:  # top-p alone: slot j holds j if kept, else -1
    return ids_bcm >= 0
  rows = jnp.arange(b * c)[:, None]
  flat_ids = jnp.where(ids_bcm >= 0, ids_bcm, vocab_size).reshape(b * c, m)
  kept = jnp.zeros((b * c, vocab_size), bool).at[rows, flat_ids].set(True, mode="drop")
  return kept.reshape(b, c, vocab_size)


def student_policy_logits(logits_bcv, rollout: Rollout):
  """π_θ under the rollout's filter: the engine's kept set replayed on the student.

      π_θ(v) = softmax(z)_v over v ∈ K_b, 0 elsewhere,  z = student logits / T

  `logits_bcv` is already divided by the temperature (`completion_logits`). This is
  the "keep sampling mask" choice: the engine's kept set K_b travels with the
  rollout rather than the trainer re-running top-k/top-p on its own logits, because
  the two rankings differ at the boundary by f32 noise even for an identical engine
  (and by the real mismatch otherwise), which would put sampled tokens outside the
  trainer's support (ratio 0, infinite KL). Replaying K_b keeps π_b and π_θ on one
  support: an exact engine reads zero, any engine gives finite metrics, and the
  sampled reverse KL is an unbiased estimator of ∇KL(π_θ ‖ π_T) for the filtered
  policy the engine deploys.

  Positions outside the completion mask keep the unfiltered logits, so padding
  (whose token need not lie in the kept set) can never produce -inf log-probs; so do the
  rows whose completion is a reference (`Rollout.on_policy_b` 0, `opd_jax.rollout.off_policy`),
  which no engine sampled, so K_b says nothing about them.

  Args:
    logits_bcv: [B, C, V] student logits at the completion positions, / T.
    rollout: the batch; its `support_ids` (or None: nothing filtered).

  Returns:
    [B, C, V] logits, -inf outside K_b at counted positions.
  """
  kept_bcv = support_mask(rollout, logits_bcv.shape[-1])
  if kept_bcv is None:
    return logits_bcv
  kept_bcv = kept_bcv | (rollout.completion_mask <= 0)[..., None]
  if rollout.on_policy_b is not None:  # dataset rows: the student unfiltered
    kept_bcv = kept_bcv | (rollout.on_policy_b <= 0)[:, None, None]
  return jnp.where(kept_bcv, logits_bcv, -jnp.inf)


def greedy_policy_logits(logits_bcv, tokens_bc):
  """The greedy engine's transform replayed: the point mass on the sampled token.

  Greedy decoding has no temperature to share and its support is {y_t}, so π_θ
  under the same transform is the point mass on y_t: 0 on y_t, -inf elsewhere.
  """
  vocab = logits_bcv.shape[-1]
  hit_bcv = jnp.arange(vocab) == tokens_bc[..., None]
  return jnp.where(hit_bcv, 0.0, -jnp.inf).astype(jnp.float32)


def reference_logprobs(reference_params, rollout: Rollout, student_cfg, loss_cfg):
  """log π_ref(y_bc) of the frozen initial student at the rollout's completion tokens; f32
  [B, C], 0 outside the mask, no gradient (GRPO's KL penalty, `opd_jax.train.rl`).

  One forward pass of `reference_params` (the student's architecture `student_cfg`), scored
  exactly as π_θ is: divided by the sampler's temperature and restricted to the engine's kept
  set (`student_policy_logits`), so that π_θ = π_ref gives k3 = 0 under every sampling setting.
  """
  raw_bcv, tokens_bc, mask_bc = teacher_forcing.completion_logits(
    reference_params, rollout, student_cfg, loss_cfg.temperature
  )
  ref_bcv = jax.lax.stop_gradient(student_policy_logits(raw_bcv, rollout))
  return jnp.where(mask_bc > 0, losses.token_logprobs(ref_bcv, tokens_bc), 0.0)


def reference_lp_if_needed(reference_params, rollout: Rollout, student_cfg, loss_cfg):
  """`reference_logprobs` when the loss has a KL penalty (`loss_cfg.needs_reference`, β > 0),
  else None.

  Raises:
    ValueError: β > 0 and no `reference_params`.
  """
  if not loss_cfg.needs_reference:
    return None
  if reference_params is None:
    raise ValueError(
      f"train.kl_coef={loss_cfg.kl_coef} needs the initial student's params: pass "
      "reference_params (a frozen copy of the student at step 0) to the train step"
    )
  return reference_logprobs(reference_params, rollout, student_cfg, loss_cfg)
