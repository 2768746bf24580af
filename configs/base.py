"""Base config for opd_jax: every field, its default and a one-line meaning.

Variants (`bf16_sync.py`, `fp8_async.py`, ...) start from `get_config()` here and
override only what differs. A variant argument after the file name shrinks a run:
`--config=configs/bf16_sync.py:tiny`.

Command: python -m opd_jax.main --config=configs/base.py --workdir=/tmp/opd
"""

import ml_collections


def model_arch(num_layers, hidden_size, num_heads, num_kv_heads, head_dim, intermediate_size):
  """Architecture of a built-in (synthetic-task) model; vocab comes from the tokenizer."""
  arch = ml_collections.ConfigDict()
  arch.model_type = "qwen3"  # llama | qwen2 | qwen3
  arch.num_layers = num_layers  # L
  arch.hidden_size = hidden_size  # D
  arch.num_heads = num_heads  # N query heads
  arch.num_kv_heads = num_kv_heads  # K key/value heads
  arch.head_dim = head_dim  # H
  arch.intermediate_size = intermediate_size  # F, SwiGLU width
  arch.tie_word_embeddings = True  # share embedding and LM head
  return arch


VARIANTS = ("tiny",)


def get_config(arg=None):
  """Returns the base ConfigDict; `arg="tiny"` shrinks it to CPU-test size."""
  if arg not in (None, *VARIANTS):
    raise ValueError(f"unknown variant {arg!r} of base.py; known: {', '.join(VARIANTS)}")
  c = ml_collections.ConfigDict()
  c.seed = 0  # global seed: init, data order, sampling
  c.tokenizer = ""  # "" = the student checkpoint's, else "char"; "char" or a tokenizer dir

  # Device mesh; -1 takes the remaining devices.
  c.mesh = ml_collections.ConfigDict()
  c.mesh.data = -1  # pure data parallelism
  c.mesh.fsdp = 1  # parameter/optimizer sharding
  c.mesh.tensor = 1  # tensor (model) parallelism

  # Student: a local HF checkpoint, or a built-in architecture when checkpoint is "".
  c.student = ml_collections.ConfigDict()
  c.student.checkpoint = ""  # local safetensors dir; "" = built-in model
  c.student.dtype = "float32"  # parameter dtype: float32 | bfloat16
  c.student.arch = model_arch(2, 128, 4, 2, 32, 384)  # built-in architecture (half the teacher)
  c.student.warmup_steps = 250  # supervised warm-start steps of a built-in student
  c.student.warmup_lr = 1e-3  # its learning rate
  c.student.warmup_batch_size = 64  # its batch size

  # Teacher: frozen; a local HF checkpoint, or bootstrapped on the built-in task.
  c.teacher = ml_collections.ConfigDict()
  c.teacher.checkpoint = ""  # local safetensors dir; "" = bootstrap on the task
  c.teacher.dtype = "float32"  # float32 | bfloat16
  c.teacher.arch = model_arch(4, 128, 4, 2, 32, 384)  # built-in architecture
  c.teacher.pretrain_steps = 1000  # supervised steps of the bootstrap
  c.teacher.pretrain_lr = 3e-3  # its peak learning rate
  c.teacher.pretrain_batch_size = 64  # its batch size
  # Train to a target (opd_jax/train/pretrain.py, train_to_target): after pretrain_steps, while the
  # held-out greedy exact-match accuracy on the built-in task is below target_accuracy, train
  # pretrain_steps/2 more steps at 0.3 x pretrain_lr, up to max_pretrain_steps in all.
  c.teacher.target_accuracy = 0.95  # in [0, 1]; 0 = off (pretrain_steps, no evaluation)
  c.teacher.max_pretrain_steps = 3000  # the cap on all phases' steps (>= pretrain_steps)
  c.teacher.target_eval_size = 256  # held-out prompts it is measured on (task's heldout split)
  c.teacher.cache_dir = ""  # where bootstrapped teachers are cached; "" = workdir/teacher_cache
  # Teacher temperature (opd_jax/model/teacher_topk.py): π_T = softmax(logits / τ_T) in every
  # loss and teacher/* metric; independent of rollout.temperature, at which the student is scored.
  c.teacher.temperature = 1.0  # τ_T > 0

  # Prompts: the built-in task or a JSONL file with a "prompt" field.
  c.data = ml_collections.ConfigDict()
  c.data.prompt_file = ""  # JSONL with {"prompt": ...}; "" = built-in task
  c.data.task = "sum"  # built-in task: sum (short) | chain (a+d*n=, n counted steps: long)
  c.data.num_operands = 3  # built-in task: operands per problem (chain: steps n; 32 ≈ 200 tokens)
  c.data.max_operand = 99  # built-in task: largest operand
  c.data.train_size = 200_000  # built-in task: training prompts per epoch
  c.data.eval_size = 256  # held-out prompts for quality/*
  c.data.batch_size = 32  # prompts per training step (global)
  # Prompt files ({"prompt": text} or {"messages": [...]} per line, opd_jax/data/prompts.py).
  c.data.max_prompt_tokens = 0  # longest prompt (tokens, bos included); 0 = no limit
  c.data.overlong = "error"  # longer prompts: truncate_left (keep the end) | drop | error
  # Held-out evaluation on your prompts (opd_jax/train/evaluate.py, opd_jax/data/scoring.py): KL
  # to the teacher always, and a score of records with an "answer". Without eval_file, a prompt file
  # loses data.eval_size records (by seed) to evaluation; the built-in task has its own split.
  c.data.eval_file = ""  # held-out JSONL ({"prompt"} or {"messages"}, optional "answer")
  c.data.eval_metric = "exact_match"  # exact_match | none | "package.module:function"

  # Rollout engine: how the behaviour policy differs from the trainer.
  c.rollout = ml_collections.ConfigDict()
  # Weights (opd_jax/model/quant.py): trainer (identical) | bf16 (cast) | quantized: fp8 (e4m3),
  # fp8_e5m2, int8, int4 (symmetric), fp4 (e2m1, MX power-of-two block scales).
  c.rollout.weights = "trainer"  # trainer | bf16 | fp8 | fp8_e5m2 | int8 | int4 | fp4
  c.rollout.weight_block_size = 0  # quantized scales: 0 = per output channel, else b×b blocks
  c.rollout.weight_group_size = 0  # quantized scales: g > 0 = one per g inputs (fp4 needs it: 32)
  c.rollout.weight_per_tensor = False  # quantized scales: one per weight matrix
  c.rollout.bf16_layers = ()  # layers kept unquantized in the quantized recipe
  c.rollout.head_dtype = "float32"  # final norm + LM head: float32 (trainer's) | bfloat16 (logits)
  c.rollout.kv_cache = "auto"  # auto (compute dtype) | bf16 | fp8 | fp8_e5m2 | fp4
  c.rollout.kv_granularity = "token_head"  # fp8 KV scales: token_head | tensor
  c.rollout.kv_bf16_layers = ()  # layers whose KV cache stays BF16
  c.rollout.noise_sigma = 0.0  # weight noise: W + sigma * rms(W) * eps
  c.rollout.noise_layers = ()  # noise only these decoder layers; () = all
  c.rollout.noise_modules = ()  # noise only these modules or groups (inference/transform); () = all
  c.rollout.kernel = "reference"  # reference | bf16_attention | bf16_matmul (numerical path)
  # auto (GPU: reference, else blockwise) | blockwise | reference | pallas (not on GPU)
  c.rollout.decode_attention = "auto"
  c.rollout.temperature = 1.0  # sampling temperature (0 = greedy)
  c.rollout.top_k = 0  # 0 = off
  c.rollout.top_p = 1.0  # nucleus mass in (0, 1]
  c.rollout.max_new_tokens = 32  # completion budget
  c.rollout.mode = "sync"  # sync (sample, then train) | async (sample ahead, double-buffered)
  c.rollout.max_lag = 1  # async: largest weight-version lag a batch is trained with
  c.rollout.max_ahead = -1  # async: versions the producer may run ahead; -1 = max_lag
  c.rollout.stale_policy = "drop"  # async, lag > max_lag: drop | correct (sampled loss only)
  c.rollout.producer_timeout_s = 600.0  # async: error when no batch arrives for this long
  c.rollout.dispatch = "auto"  # async: thread | inline (one controller) | auto (by process count)
  c.rollout.devices = 0  # devices set apart for rollouts (last n/P of each process's); 0 = shared
  c.rollout.score_teacher = False  # the engine scores rollouts with the frozen teacher
  c.rollout.stale_k = 0  # sync: sample with the weights k versions old (deterministic stale-k)
  # Rollout mesh (opd_jax/rollout/sources.py): the engine's weights on their own (data, fsdp,
  # tensor) mesh over the training devices; all three 0 = sample on the training mesh.
  c.rollout.mesh_data = 0  # rollout data axis (-1 = the devices the others leave)
  c.rollout.mesh_fsdp = 0  # rollout fsdp axis (weights split, gathered once per batch)
  c.rollout.mesh_tensor = 0  # rollout tensor axis (heads, MLP width, vocabulary)
  # Several samples per prompt (opd_jax/rollout/sources.py): data.batch_size counts prompts.
  c.rollout.samples_per_prompt = 1  # completions per prompt (adjacent rows; B·n per step)

  # Optimisation.
  c.train = ml_collections.ConfigDict()
  c.train.steps = 1000  # OPD steps (the learning-rate schedule's length)
  c.train.stop_after = 0  # stop (with a checkpoint) at this step; 0 = run all train.steps
  c.train.seed = -1  # the run's data order and sampling; -1 = seed (models keep seed)
  # Exact per-token KL over the vocabulary: the lowest-variance OPD estimator, and cheap
  # for small vocabularies. reverse_kl_sampled is the Tinker/slime policy-gradient form.
  c.train.loss = "reverse_kl_full"  # reverse_kl_sampled | reverse_kl_full | forward_kl | jsd
  # RL baseline (opd_jax/train/rl.py): train.loss="reinforce" is REINFORCE on the task's reward
  # (train.reward) with a leave-one-out baseline, truncated IS by train.is_clip; needs no teacher.
  # train.loss="grpo" is GRPO (group baseline, PPO clip); it reads the keys below, not is_clip.
  c.train.is_clip = 2.0  # truncated importance ratio C; <= 0 disables
  # The RL losses' reward (opd_jax/data/rewards.py), scored by the rollout engine; the other
  # losses ignore it. step (grpo only): each written step's tokens get that step's advantage.
  c.train.reward = "exact_match"  # exact_match (1 or 0) | partial (share of right steps) | step
  # GRPO (opd_jax/train/rl.py): train.loss="grpo", groups of rollout.samples_per_prompt >= 2.
  c.train.group_std_normalize = True  # grpo: advantage ÷ (std of the group's rewards + 1e-6)
  c.train.ppo_clip = 0.2  # grpo: ε of the clip of π_θ/π_old
  c.train.ppo_epochs = 1  # grpo: passes over each batch
  c.train.ppo_minibatches = 1  # grpo: updates per pass (divide B·n); epochs × this updates/step
  c.train.mismatch_correction = "none"  # grpo, of π_old/π_engine: none|tis|mis|seq_tis|seq_mis
  c.train.mismatch_clip = 2.0  # grpo: C, truncation (tis) or kept band [1/C, C] (mis)
  # grpo: β of the k3 KL(π_θ ‖ π_ref) to the initial student at the sampled tokens, added to the
  # loss; > 0 keeps a frozen copy of the step-0 student and scores it once per step.
  c.train.kl_coef = 0.0  # grpo: β >= 0; 0 = off (refused > 0 with the other losses)
  c.train.advantage_clip = 0.0  # reverse_kl_sampled: clip A_t to [-c, c]; 0 disables
  # reverse_kl_sampled: baseline subtracted from A_t (losses.reverse_kl_sampled).
  c.train.advantage_baseline = "none"  # none | batch_mean (mean A over the other sequences)
  c.train.jsd_beta = 0.5  # beta for loss=jsd
  c.train.mismatch_top_k = (
    0  # mismatch/kl over: 0 = auto (full V <= 4096, else top-64), -1 = full, k
  )
  c.train.mismatch_bucket_tokens = 16  # mismatch/kl_by_position/*: positions per bucket; 0 = off
  c.train.mismatch_cross_kl = 0.1  # mismatch/first_cross_pos: a token crosses at KL_t > this
  c.train.lr = 1e-3  # peak AdamW learning rate
  c.train.warmup_steps = 10  # linear warmup
  c.train.weight_decay = 0.0  # AdamW decoupled weight decay
  c.train.grad_clip = 1.0  # global-norm clip
  c.train.log_every = 10  # steps between metric lines
  c.train.eval_every = 200  # steps between held-out evaluations; 0 = no evaluation
  # also score one T = 1 sample of each held-out prompt (quality/student_<metric>_t1)
  c.train.eval_sampled = False  # beside the greedy score; one more decode per evaluation
  c.train.checkpoint_every = 200  # steps between orbax checkpoints
  c.train.keep_checkpoints = 2  # checkpoints kept
  # Resuming with another train.steps (trainer.schedule_length): the checkpoint stores its
  # learning-rate schedule's length.
  c.train.resume_schedule = "keep"  # keep (stored schedule) | rebuild (over train.steps) | error
  # Memory controls (opd_jax/train/train_step.py, opd_jax/model/transformer.py): same update,
  # less memory.
  c.train.microbatches = 1  # gradient-accumulation micro-batches per step (divide B·n)
  c.train.remat = "none"  # per-layer rematerialisation: none | layer | dots | dots_no_batch
  # GKD's λ (opd_jax/rollout/off_policy.py): the rest of each batch's prompts train on their
  # reference completions ("completion", or a final assistant message); reverse_kl_sampled needs 1.
  c.train.on_policy_fraction = 1.0  # share of prompts per batch with sampled completions
  # Sparse teacher (opd_jax/model/teacher_topk.py): per token, the teacher's top-k log-probs plus
  # one tail bucket instead of its full logits; every OPD loss is computed on those k + 1 bins.
  c.train.teacher_top_k = 0  # k in [0, V]; 0 = the full vocabulary (the exact reference)

  # Mismatch budget guard (opd_jax/mismatch/live_guard.py): mismatch/kl against a budget file.
  c.budget = ml_collections.ConfigDict()
  c.budget.file = ""  # budget file (opd_jax.budget.save_budget); "" = no guard
  c.budget.action = "warn"  # over budget for `patience` steps: warn | fallback | adaptive
  c.budget.patience = 20  # consecutive over-budget steps (of the moving average) before acting
  c.budget.smoothing = 0.9  # decay of the mismatch/kl moving average compared; 0 = per step
  c.budget.recheck_every = 200  # adaptive: steps between re-measurements of the ladder
  c.budget.prompts = 64  # adaptive: calibration prompts per measurement
  c.budget.conservative = False  # compare with the lower end of the budget's interval
  c.budget.per_source = True  # hold each rung to its sources' limits (else the pooled budget)
  c.budget.force = False  # run with a stale budget (fingerprint changed) instead of refusing
  c.budget.extrapolate = "refuse"  # a rung beyond the budget's records: refuse | pooled | default

  # Export: a finished run writes its student as a Hugging Face checkpoint (opd_jax/export.py:
  # weights, config.json and generation_config.json with the token ids, the tokenizer).
  c.export = ml_collections.ConfigDict()
  c.export.dir = ""  # "" = <workdir>/export; "none" = no export; else this directory

  # Where the scalars go besides TensorBoard and metrics.jsonl (opd_jax/io/metrics_writer.py).
  c.log = ml_collections.ConfigDict()
  c.log.wandb_project = ""  # a Weights & Biases project (pip install -e ".[wandb]"); "" = off
  return shrink_to_tiny(c) if arg == "tiny" else c


def shrink_to_tiny(c):
  """The `:tiny` variant of any config: seconds on a CPU, for wiring checks, not quality."""
  c.teacher.arch = model_arch(1, 32, 4, 2, 8, 64)
  c.teacher.pretrain_steps = 20
  c.teacher.pretrain_batch_size = 16
  c.teacher.target_accuracy = 0.0  # fixed steps: a tiny teacher is not held to a quality
  c.student.arch = model_arch(1, 32, 4, 2, 8, 64)
  c.student.warmup_steps = 5
  c.student.warmup_batch_size = 16
  c.data.batch_size = 8
  c.data.eval_size = 16
  c.rollout.max_new_tokens = 28
  c.train.steps = 6
  c.train.log_every = 2
  c.train.eval_every = 3
  c.train.checkpoint_every = 3
  return c
