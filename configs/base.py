"""The config schema every family shares, so that overrides read the same everywhere.

A family's config file calls `base_config(family)` and fills in `model.*` and its presets.
Overrides: `--config.train.lr=1e-3`, `--config.mesh.fsdp=2`, `--config.data.source=text:/path/*.txt`.

Each default is written once (tests/test_config_schema.py checks it):
  here          the keys every family reads
  get_config    the family's own keys and the shared ones it defaults differently; `model.*` are
                all the family's own, each a field of its model-config dataclass (models/), since
                validation refuses any other key there
  PRESETS       only what a preset changes: no entry equal to the value it would get anyway
A run's model config is its `model.*` keys plus what the data resolves (vocabulary, classes), so
the model-config dataclasses' defaults of the fields `model.*` holds are never a run's: they are
the Python API's, and what Hugging Face imports and model.json files saved before a field existed
get (GPT2Config.vocab_multiple = 1 where runs use 128). Configs are plain data that never import
models/, so they write a run's defaults themselves.
"""
import ml_collections

from errors import ConfigError


def base_config(family: str, preset: str = '', presets: dict | None = None) -> ml_collections.ConfigDict:
  """The shared defaults for `family`; `preset` must be a key of the family's `presets`."""
  if presets is not None and preset not in presets:
    raise ConfigError(f'Unknown {family} preset {preset!r}; choose one of {sorted(presets)}.')
  c = ml_collections.ConfigDict()
  c.family = family  # the model family: the configs/<family>.py and train/tasks/<family>.py that run
  c.preset = preset  # the preset of configs/<family>.py this config started from ('' = its defaults)
  c.seed = 0  # parameter initialisation, dropout, data shuffling and sampling
  c.rng_impl = 'auto'  # 'auto' (rbg on GPU/TPU, threefry on CPU) | 'threefry' | 'rbg' | 'unsafe_rbg'
  c.compile_cache = '~/.cache/attention-lineage/jax'  # JAX's persistent compilation cache; '' = off
  c.init_from = ''  # workdir of a run whose parameters initialise this one (fine-tuning)

  c.model = ml_collections.ConfigDict()  # the family's model-config fields, filled in by its get_config
  c.data = data_defaults()
  c.train = train_defaults()
  c.logging = ml_collections.ConfigDict()
  c.logging.wandb_project = ''  # log to Weights & Biases as well as TensorBoard; '' = off
  c.logging.wandb_entity = ''  # W&B team or user; '' = your default entity
  c.mesh = ml_collections.ConfigDict()
  c.mesh.data = -1  # -1 = all devices not used by the other axes
  c.mesh.fsdp = 1  # devices parameters and optimizer state are sharded over (and the batch split over)
  c.mesh.tensor = 1  # devices attention heads and MLP width are split over (tensor parallelism)
  c.mesh.expert = 1  # devices a mixture of experts' experts are split over (and the batch split over)
  c.decode = decode_defaults()
  return c


def data_defaults() -> ml_collections.ConfigDict:
  """config.data's shared fields: sources, tokenizer, token caches."""
  # Splits: a source named for a split is used whole; a split not named is carved out of `source`,
  # which trains on the rest (the rule: data/sources.py).
  data = ml_collections.ConfigDict()
  data.source = ''  # training: 'tfds:<name>[:<split>]', 'text:<glob>', 'tsv:<path>' or a built-in name
  data.eval_source = ''  # validation (evaluated during training, picks the best checkpoint); '' = out of `source`
  data.test_source = ''  # the final evaluation; '' = the eval_source data (out of `source` when that is '' too)
  data.max_malformed_fraction = 0.01  # tsv: malformed lines are skipped and counted; above this share, an error
  data.tsv_header = False  # tsv: True skips the first line (column names); False warns when it looks like one
  data.seq_len = 128  # tokens per example row (a pair's side, a text's input); longer examples are cut or dropped
  data.tokenizer = 'bpe'  # 'char' | 'bpe' | 'wordpiece'
  data.vocab_size = 8192  # size of the tokenizer trained on the data ('char': ignored)
  data.lowercase = True  # wordpiece: lowercase text before tokenizing (BERT's uncased normalizer)
  data.max_examples = 0  # 0 = all; a cap for quick runs
  # Token caches (data/token_cache.py): corpora tokenized once, read back row by row; local or gs://,
  # shared by every run on the same corpus and tokenizer (and, on a pod, reached by every host).
  data.cache_dir = '~/.cache/attention-lineage/data'  # where token caches and tokenizers live; local or gs://
  data.cache_shard_mb = 32.0  # text per cache shard: the unit of parallel and resumable building
  data.cache_workers = 0  # processes building a cache's shards at once: 0 = one per core (up to 8) from 16 MB of text
  return data


def train_defaults() -> ml_collections.ConfigDict:
  """config.train's shared fields, in parts: the run's length and schedule, the optimizer and loss,
  evaluations, checkpoints, what stops a run early, and LoRA."""
  train = ml_collections.ConfigDict()
  schedule_keys(train)
  optimizer_keys(train)
  evaluation_keys(train)
  checkpoint_keys(train)
  stopping_keys(train)
  lora_keys(train)
  return train


def schedule_keys(train: ml_collections.ConfigDict) -> None:
  """The run's length, batch and learning-rate schedule."""
  train.steps = 1000  # optimizer steps of the whole run (resumes included)
  train.batch_size = 32  # global, across all devices and hosts
  train.grad_accum = 1  # micro-batches per step
  train.lr = 3e-4  # peak learning rate (muon: of the matrices)
  train.schedule = 'cosine'  # 'constant' | 'cosine' | 'linear' | 'rsqrt' | 'wsd' (train/optim.py)
  train.warmup_steps = 100  # linear warmup (schedule_free_adamw: its own warmup)
  train.end_lr_fraction = 0.1  # final lr / peak lr for 'cosine', 'linear' and 'wsd'
  # wsd: the cooldown's share of train.steps (not starting before train.warmup_steps end); with train.max_minutes
  # and a train.steps the budget will not reach, the cooldown starts when this share of the budget is left (from
  # the rate the warmup reached, if it is not over), is re-planned at every step from the recent step time, and
  # the run's last step uses lr * end_lr_fraction.
  train.decay_fraction = 0.2
  train.decay_shape = '1-sqrt'  # wsd's cooldown: 'linear' | '1-sqrt' (Hägele et al. 2024)


def optimizer_keys(train: ml_collections.ConfigDict) -> None:
  """The optimizer, its clipping, and the loss's extra terms."""
  # 'adamw' | 'adam' | 'muon' | 'schedule_free_adamw' | 'lion' | 'adafactor', all Optax's (train/optim.py)
  train.optimizer = 'adamw'
  train.b1 = 0.9  # first-moment decay (Adam, Muon's AdamW, Lion); schedule_free_adamw: its interpolation
  train.b2 = 0.95  # second-moment decay (Adam, Muon's AdamW, schedule_free_adamw); Lion's update decay
  train.eps = 1e-8  # Adam-style optimizers' epsilon
  train.weight_decay = 0.1  # decoupled (times the lr), on kernels only; muon: on the matrices it takes
  train.adam_lr = 0.0  # muon: peak lr of its AdamW (embeddings, output layers, norms, biases); 0 = train.lr
  train.muon_momentum = 0.95  # muon: momentum of the matrices' gradients (Nesterov)
  # muon: each matrix's update scaled to this RMS (Optax's consistent_rms, Moonlight's 0.2: AdamW's),
  # so Muon takes AdamW's lr and weight decay and its lr holds across widths; 0 = Keller Jordan's
  # sqrt(max(1, fan_out / fan_in)) scaling, whose lr is ~0.02.
  train.muon_rms_scale = 0.2
  train.muon_ns_dtype = 'auto'  # muon: Newton-Schulz matmuls: auto (bf16 on GPU/TPU, f32 on CPU) | float32 | bfloat16
  train.grad_clip = 1.0  # global-norm clipping; 0 disables
  train.label_smoothing = 0.0  # share of the target's probability spread uniformly over the vocabulary or classes
  # z-loss (PaLM: 1e-4): this coefficient times log(Z)^2 per token added to the minimised loss of the
  # families with a vocabulary softmax (GPT, Transformer, BERT pretraining, RNN LM, seq2seq); logged
  # as train/z_loss and eval/z_loss, while eval/loss stays the plain cross-entropy. 0 = off.
  train.z_loss = 0.0


def evaluation_keys(train: ml_collections.ConfigDict) -> None:
  """Evaluations during training and the final one."""
  train.eval_every = 200  # steps between evaluations on the validation split
  train.eval_steps = 20  # eval batches per evaluation; 0 = the whole eval split
  train.eval_batch_size = 0  # 0 = train.batch_size
  # The final evaluation (after training, and --mode=eval) scores at most final_eval_examples of the
  # validation split and of each split its family scores after training: every (size / N)-th
  # example, the same ones every run. 50,000 keeps every built-in split whole (the largest: GPT's
  # tiny preset, ~36,500 pystdlib windows); for a larger split, the standard error of a mean over
  # 50,000 examples is 0.0045 x the examples' spread (an accuracy's at most 0.22 points).
  # Translation decodes final_decode_examples test pairs (greedy and beam search, far slower than a
  # loss): an exact-match rate over 1,000 has a standard error of at most 1.6 points.
  train.final_eval_examples = 50_000  # examples per split the final evaluation scores, evenly spaced; 0 = all
  train.final_decode_examples = 1_000  # test pairs translation decodes at the end (BLEU), evenly spaced; 0 = all
  # Downstream tasks during training (decoder families: GPT): lm-eval tasks, comma-separated (evals/tasks/ names,
  # lm-eval's own, or task YAML files), scored on the current weights at evaluations and logged beside eval/loss
  # as tasks/<task>/<metric> (train.best_metric and train.target may name them); '' = off.
  train.eval_tasks = ''
  train.eval_tasks_every = 0  # steps between scorings, a multiple of eval_every (and the last); 0 = every evaluation
  train.eval_tasks_limit = 100  # documents per task, evenly spaced (the same every run); 0 = all
  train.eval_tasks_include_path = ''  # a directory of task YAML files beside evals/tasks/ ('' = none)


def checkpoint_keys(train: ml_collections.ConfigDict) -> None:
  """Checkpoints, the best of them, and resuming."""
  train.checkpoint_every = 200  # steps between checkpoints (every evaluated step is saved too)
  train.keep_checkpoints = 3  # the latest K, plus the best by `best_metric`
  train.best_metric = 'eval/loss'  # the metric that picks the best checkpoint (and early stopping)
  train.best_mode = 'min'  # 'min' | 'max': which way best_metric is better
  train.final_eval_from = 'best'  # 'best' (by best_metric) | 'last': the checkpoint the final evaluation scores


def stopping_keys(train: ml_collections.ConfigDict) -> None:
  """What ends a run before train.steps, and the rest of the loop's settings."""
  train.early_stopping_patience = 0  # stop after this many evaluations without a better best_metric; 0 = off
  # Wall-clock budget in minutes (0 = none) on the run's clock, which starts at train_and_evaluate's entry and
  # counts all of it: data preparation, setup, restoring, compiling, steps, evaluations and saves, each resume
  # adding its own. The loop stops once the budget less a reserve is spent, so that the run's result comes
  # within it: the reserve is the closing work as timed in the run (the stop's evaluation and its save to the
  # end of its writing, the best checkpoint's restore, the final evaluation's losses and the family's decoding;
  # not its pictures). wsd's cooldown ends within it.
  train.max_minutes = 0.0
  # A clock to a target: 'eval/loss<=3.28' (an eval metric, <= or >=): the first evaluation meeting it
  # records its step, tokens and seconds (target/... in metrics.jsonl and the result); '' = none.
  train.target = ''
  train.stop_at_target = False  # save and end the run (then the final evaluation) when train.target is met
  train.log_every = 10  # steps between logged training metrics
  train.async_checkpoints = True  # write checkpoints in the background (Orbax) while training goes on
  # Resuming a workdir with other data.source / eval_source / test_source is refused unless True;
  # then config.json's data_history records each with the step it started at.
  train.allow_data_change = False


def lora_keys(train: ml_collections.ConfigDict) -> None:
  """Parameter-efficient fine-tuning: LoRA adapters over a frozen base run."""
  # LoRA (train/lora.py, models/lora.py): rank > 0 trains low-rank adapters on the projections lora_targets
  # names over the frozen weights of the run config.init_from names (needed); checkpoints hold the adapters
  # only. 0 = full fine-tuning (or training from scratch).
  train.lora_rank = 0
  train.lora_alpha = 16.0  # the adapters' outputs are scaled by lora_alpha / lora_rank
  train.lora_dropout = 0.0  # share of the adapters' inputs dropped in training
  # Comma-separated: q, k, v, o (attention), up, gate, down (MLP), or regular expressions searched in the
  # projections' paths (e.g. 'blocks/(10|11)/self_attention/query'); q,v as in the LoRA paper.
  train.lora_targets = 'q,v'


def decode_defaults() -> ml_collections.ConfigDict:
  """config.decode's shared fields: sampling and beam search."""
  decode = ml_collections.ConfigDict()
  decode.max_new_tokens = 64  # generative families: tokens generated per prompt
  decode.temperature = 1.0  # 0 = greedy
  decode.top_k = 0  # 0 = off
  decode.top_p = 1.0  # 1 = off
  decode.beam_size = 4  # translation: beam width (1 = greedy)
  decode.length_penalty = 0.6  # GNMT alpha
  decode.max_len_ratio = 1.5  # beam search: max target length = ratio * source length + 10
  # GPT, RNN LM: continuations the end of a run prints (and writes to samples.json), of decode.prompts
  # taken in turn (3 prompts, 6 samples: two draws each); 0 or no prompts = none
  decode.num_samples = 3
  decode.prompts = ''  # '|'-separated prompts the samples continue
  return decode


def apply_preset(c: ml_collections.ConfigDict, presets: dict) -> ml_collections.ConfigDict:
  """Overlay presets[c.preset] on the family's defaults: {section: {key: value}}, or a value for a
  top-level field such as `task`."""
  for name, values in presets[c.preset].items():
    if isinstance(values, dict):
      c[name].update(values)
    else:
      c[name] = values
  return c


def flatten(config, prefix: str = '') -> dict:
  """{'train.lr': 3e-4, ...}: a config's (or a nested dict's) keys, dotted, and their values."""
  out = {}
  for key, value in config.items():
    name = f'{prefix}{key}'
    if isinstance(value, (ml_collections.ConfigDict, dict)):
      out.update(flatten(value, name + '.'))
    else:
      out[name] = value
  return out
