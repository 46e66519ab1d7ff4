"""GPT-2 language model on the Python standard library's source code (offline, built in).

Command (CPU, 2 cores):
  python launch.py --config=configs/gpt.py:default
The recipe (issue 33): Muon (train.lr = train.adam_lr = 4e-3), warmup-stable-decay (20 warmup steps,
the last 20% cooled, 1-sqrt), QK-norm, ReLU^2, logits soft-capped at 15, zero-initialised output
projections. Chosen by the ablation
  python launch.py --sweep=configs/sweeps/gpt_recipe_ablation.py --workdir=runs/gpt-recipe-ablation
and kept after the TPE study of configs/sweeps/gpt_recipe.py found nothing better than a seed's spread.
Data: held-out stdlib files, a 2,048-token byte-level BPE, 32 x 128 tokens a step. Its results (the
ablation, the study, its 400 steps, its time to the 2019 recipe's loss on CPU and on an H200) are
data in measurements/ (gpt_recipe_ablation.csv, gpt_recipe_study.csv, families.csv,
gpt_time_to_target.csv), each row with its date, commit and machine; docs/families/gpt.md reports them.

Presets:
  tiny         tests: seconds, character-level
  default      the CPU main job above
  gpt2         GPT-2 small, exactly 124,439,808 parameters (vocab 50,257, 1,024 positions); stored:
               124,475,904, the embedding padded to 50,304 rows (model.vocab_multiple, zero rows never used)
  gpt2-medium  GPT-2 medium, 354,823,168 parameters (stored: 354,871,296)
  bench        the reference benchmark shapes (6 layers, 384 wide, 6 heads, vocab 8,192, batch 8 x 256);
               its speed against HF GPT-2 and HF generate: docs/benchmarks.md, from measurements/speed_raw.jsonl
  llama        the Llama-style decoder (RoPE, RMSNorm, SwiGLU, 2 KV heads for 4 query heads, no biases)
               at the `default` preset's size (3,746,048 parameters against 3,749,376) on the same text
  llama-bench  the `bench` shapes, Llama-style (2 KV heads, SwiGLU 1,024 wide)
  smollm-135m  SmolLM-135M: 134,515,008 parameters (30 layers, 576 wide, 9 heads, 3 KV heads)
  llama-3.2-1b Llama 3.2 1B: 1,235,814,400 parameters (16 layers, 2,048 wide, 32 heads, 8 KV heads,
               Llama 3 RoPE scaling)
  Import either from Hugging Face instead of training it: python launch.py --mode=import_hf --hf_dir=DIR
  --workdir=RUN (docs/families/gpt.md, Llama-style decoders).
  moe          `default` as a mixture of experts: 8 experts of width 510, top-2, in every block:
               10,011,648 parameters, 3,744,768 active per token against `default`'s 3,749,888 (its
               MLP biases; the experts have none)
  mixtral-8x7b   Mixtral 8x7B: 46,702,792,704 parameters, 12,879,925,248 active per token (--mode=compile)
  qwen3-30b-a3b  Qwen3-30B-A3B: 30,532,122,624 parameters, 3,353,032,704 active (128 experts, top-8; --mode=compile)
  olmoe-1b-7b    OLMoE-1B-7B: 6,919,100,416 parameters, 1,281,955,840 active (64 experts, top-8; per-head
                 QK-norm, 61,440 parameters fewer than OLMoE's; --mode=compile)
  Import a Mixtral or Qwen3-MoE from Hugging Face with --mode=import_hf (it starts from `moe`'s recipe).

Decoder options (issue 33), each usable alone with the GPT-2 or the Llama block, all off by default:
  --config.model.qk_norm=True          RMSNorm of query and key heads (a learned [D] scale each), before RoPE
  --config.model.mlp=relu2             a plain MLP with relu(x)^2
  --config.model.logit_softcap=15.0    logits -> 15 tanh(logits / 15), in the losses and in decoding
  --config.model.zero_init_out=True    attention output and MLP down projections start at zero
  --config.train.z_loss=1e-4           + 1e-4 log(Z)^2 per token in the minimised loss (train/z_loss,
                                       eval/z_loss logged apart; eval/loss stays the cross-entropy)
  Hugging Face's GPT2LMHeadModel and LlamaForCausalLM have none of the first three: --mode=export_hf
  refuses a model with one. No tuned values are claimed here.

Other data: --config.data.source=text:'/path/*.txt' or tfds:<name>[:<split>] (a 'text' feature).
Documents (files, records) are joined by EOS into one stream cut into windows; --config.data.document_masking=True
keeps each window's attention and positions within its documents (models/gpt.py `document_segments`). Off
by default: not yet measured against the unmasked windows.
"""
from configs.base import apply_preset, base_config

# What GPT-2 small and medium share: 1,024 positions, dropout, the 50,257-token vocabulary, the schedule.
GPT2 = dict(model=dict(max_len=1024, dropout=0.1), data=dict(vocab_size=50257, seq_len=1024),
            train=dict(steps=600000, batch_size=512, warmup_steps=2000, eval_every=2000, checkpoint_every=2000))
PRESETS = {
    'tiny': dict(model=dict(num_layers=2, num_heads=2, width=32, max_len=64),
                 data=dict(tokenizer='char', seq_len=32, max_examples=2000),
                 train=dict(steps=20, batch_size=8, lr=3e-3, warmup_steps=5, eval_every=10, eval_steps=2,
                            checkpoint_every=10, log_every=5),
                 decode=dict(max_new_tokens=16)),
    # The recipe of configs/sweeps/gpt_recipe_ablation.py's best trial (issue #33): Muon, warmup-stable-decay,
    # the speedrun block. The 2019 recipe it replaced: AdamW, warmup 50 + cosine, GPT-2 block (kept by 'llama').
    'default': dict(model=dict(qk_norm=True, mlp='relu2', logit_softcap=15.0, zero_init_out=True),
                    data=dict(vocab_size=2048),
                    train=dict(steps=400, optimizer='muon', lr=4e-3, adam_lr=4e-3, schedule='wsd', warmup_steps=20,
                               log_every=20),
                    decode=dict(max_new_tokens=96, temperature=0.7,
                                prompts='def fibonacci(n):|import os\n\n\nclass |    for key, value in ')),
    'gpt2': dict(GPT2, model=dict(GPT2['model'], num_layers=12, num_heads=12, width=768),
                 train=dict(GPT2['train'], lr=6e-4)),
    'gpt2-medium': dict(GPT2, model=dict(GPT2['model'], num_layers=24, num_heads=16, width=1024)),
    'bench': dict(model=dict(num_layers=6, num_heads=6, width=384),
                  data=dict(seq_len=256),
                  train=dict(batch_size=8, weight_decay=0.0, grad_clip=0.0),
                  decode=dict(max_new_tokens=128, temperature=0.0)),
}
# The Llama steps (models/gpt.py); tied embeddings as in SmolLM and Llama 3.2 1B.
LLAMA = dict(positions='rope', norm='rmsnorm', mlp='swiglu', use_bias=False)
PRESETS |= {
    # The 2019 recipe (AdamW, cosine), not retuned: measurements/llama_vs_gpt2.csv compares it with GPT-2.
    'llama': dict(PRESETS['default'], model=dict(LLAMA, num_kv_heads=2, mlp_hidden=792),
                  train=dict(steps=400, lr=2e-3, warmup_steps=50, log_every=20)),
    'llama-bench': dict(PRESETS['bench'], model=dict(LLAMA, num_layers=6, num_heads=6, num_kv_heads=2, width=384,
                                                       mlp_hidden=1024)),
    'smollm-135m': dict(model=dict(LLAMA, num_layers=30, num_heads=9, num_kv_heads=3, width=576, mlp_hidden=1536,
                                   max_len=2048),
                        data=dict(vocab_size=49152, seq_len=2048)),
    'llama-3.2-1b': dict(model=dict(LLAMA, num_layers=16, num_heads=32, num_kv_heads=8, width=2048, mlp_hidden=8192,
                                    max_len=131072, rope_theta=500000.0, rope_scaling='llama3', rope_factor=32.0),
                         data=dict(vocab_size=128256, seq_len=2048)),
}
# Mixtures of experts (models/moe.py): `moe` trains on the built-in corpus; the published shapes are for
# --mode=compile (their parameter counts: tests/test_moe.py).
PRESETS |= {
    # `default` with 8 experts, top-2, 510 wide: per token 2 x (2 x 256 x 510) + the 256 x 8 router =
    # 524,288 MLP weights per block, as many as the dense default's 2 x 256 x 1,024.
    # Balanced by the auxiliary loss and DeepSeek-V3's loss-free bias together (train.moe_aux_loss,
    # model.moe_router_bias).
    'moe': dict(PRESETS['default'], model=dict(PRESETS['default']['model'], moe_experts=8, moe_hidden=510,
                                               moe_router_bias=True)),
    'mixtral-8x7b': dict(model=dict(LLAMA, num_layers=32, num_heads=32, num_kv_heads=8, width=4096, moe_experts=8,
                                    moe_hidden=14336, max_len=32768, rope_theta=1e6, tie_embeddings=False),
                         data=dict(vocab_size=32000, seq_len=4096)),
    # Qwen3's heads are 128 wide whatever the width (32 x 128 = 4,096 query features for 2,048).
    'qwen3-30b-a3b': dict(model=dict(LLAMA, num_layers=48, num_heads=32, num_kv_heads=4, head_dim=128, width=2048,
                                     qk_norm=True, moe_experts=128, moe_top_k=8, moe_hidden=768, max_len=40960,
                                     rope_theta=1e6, layer_norm_epsilon=1e-6, tie_embeddings=False),
                          data=dict(vocab_size=151936, seq_len=4096)),
    # OLMoE normalises the whole query and key projections ([2,048] scales); qk_norm here is per head ([128]).
    'olmoe-1b-7b': dict(model=dict(LLAMA, num_layers=16, num_heads=16, width=2048, qk_norm=True, moe_experts=64,
                                   moe_top_k=8, moe_hidden=1024, moe_norm_topk_prob=False, max_len=4096,
                                   tie_embeddings=False),
                        data=dict(vocab_size=50304, seq_len=4096)),
}

# `--mode=import_hf` without --config: the preset a Hugging Face config.json's model_type starts from.
HF_MODEL_TYPES = {'gpt2': 'gpt2', 'llama': 'llama', 'mixtral': 'moe', 'qwen3_moe': 'moe'}


def get_config(preset: str = 'default'):
  c = base_config('gpt', preset, PRESETS)
  c.data.source = 'pystdlib'
  c.data.document_masking = False  # True: attention and positions restart at each EOS (a window's documents apart)
  c.model.attention = 'auto'  # 'auto' (GPU: cudnn, jax_nn for float32; TPU: splash; else xla) | 'xla' | 'cudnn' | 'jax_nn' | 'splash'
  c.model.vocab_size = 0  # 0 = the tokenizer's size; an imported checkpoint sets its own
  # Embedding rows padded to a multiple of this (whole matmul tiles for the output layer); the padded
  # ids are never predicted. A run config without this key is unpadded (vocab_multiple=1).
  c.model.vocab_multiple = 128
  c.model.dtype = 'auto'  # compute dtype, weights stay float32: auto (bf16 on GPU/TPU, f32 on CPU) | float32 | bfloat16
  c.model.dropout = 0.0  # training: rate on the embeddings, the attention weights and each block's branches
  c.model.num_layers = 4  # decoder blocks
  c.model.num_heads = 4  # query heads per attention
  c.model.width = 256  # the residual stream's features (the embedding width)
  c.model.mlp_ratio = 4  # the MLP's hidden width as a multiple of width (when mlp_hidden is 0)
  c.model.max_len = 256  # longest sequence: learned positions' rows, and prompt + new tokens in decoding
  c.model.layer_norm_epsilon = 1e-5  # added to the variance in every LayerNorm / RMSNorm
  c.model.scan_layers = False  # one nnx.scan over stacked blocks: compile time flat in depth
  c.model.remat = 'none'  # 'none' | 'dots' | 'full': recompute activations in the backward pass
  # The Llama steps, each usable alone (models/gpt.py); these defaults are GPT-2.
  c.model.positions = 'learned'  # 'learned' | 'rope' (rotary, models/rope.py)
  c.model.rope_theta = 10000.0  # rope: the base wavelength, frequencies theta^(-2i / head width)
  c.model.rope_scaling = 'none'  # 'none' | 'llama3' (Llama 3.1's long-context frequency scaling, the keys below)
  c.model.rope_factor = 8.0  # llama3 scaling: long wavelengths are divided by this
  c.model.rope_low_freq_factor = 1.0  # llama3: wavelengths beyond original_max_len / this are scaled
  c.model.rope_high_freq_factor = 4.0  # llama3: wavelengths below original_max_len / this are kept
  c.model.rope_original_max_len = 8192  # llama3: the context length the model was first trained at
  c.model.norm = 'layernorm'  # 'layernorm' | 'rmsnorm'
  c.model.mlp = 'gelu'  # 'gelu' | 'swiglu' | 'relu2' (a plain MLP with relu(x)^2, the speedrun's)
  c.model.mlp_hidden = 0  # the MLP's hidden width; 0 = mlp_ratio * width
  c.model.num_kv_heads = 0  # key/value heads: 0 = num_heads (multi-head), 1 = multi-query, else grouped-query
  c.model.use_bias = True  # biases in every projection and norm (False: Llama's none)
  c.model.tie_embeddings = True  # the output layer is the token embedding's transpose
  # The NanoGPT speedrun's block options, each usable alone with either architecture (models/gpt.py);
  # off by default. None exports to Hugging Face but zero_init_out (and train.z_loss).
  c.model.qk_norm = False  # RMSNorm of each query and key head (a learned [D] scale each), before RoPE
  c.model.logit_softcap = 0.0  # logits -> c * tanh(logits / c) in the losses and in decoding; 0 = off
  c.model.zero_init_out = False  # attention output and MLP down projections start at zero
  c.model.head_dim = 0  # each attention head's width; 0 = width // num_heads (Qwen3 sets it apart)
  # Mixture of experts (models/moe.py), usable with either architecture; moe_experts = 0 is the dense model.
  c.model.moe_experts = 0  # routed experts per MoE block; 0 = dense
  c.model.moe_top_k = 2  # experts each token is routed to
  c.model.moe_shared_experts = 0  # always-on experts: a dense MLP of this many experts' width beside the routed ones
  c.model.moe_every = 1  # block i (from 0) holds experts when (i + 1) % moe_every == 0; scan_layers needs 1
  c.model.moe_hidden = 0  # each expert's hidden width; 0 = the dense MLP's (mlp_hidden or mlp_ratio * width)
  c.model.moe_norm_topk_prob = True  # the k chosen probabilities renormalised to sum to 1 (Mixtral, Qwen3-MoE)
  c.model.moe_capacity_factor = 0.0  # 0 = dropless (grouped matmuls); > 0: each expert takes this x its even share
  c.model.moe_router_bias = False  # DeepSeek-V3's auxiliary-loss-free balancing: a load-driven bias on the choice
  c.train.moe_aux_loss = 0.01  # MoE: coefficient of the Switch load-balancing loss (N sum_i f_i P_i, 1 = even)
  c.train.moe_z_loss = 0.001  # MoE: coefficient of the router z-loss (mean logsumexp(router logits)^2)
  c.train.moe_bias_rate = 0.001  # MoE with moe_router_bias: the bias' step, bias_i += rate * sign(mean load - load_i)
  # Cross-entropy this many tokens at a time, so no [B, L, V] float32 logits exist; 0 = all at once
  # (docs/benchmarks.md, Where the time goes, has XLA's temporaries for a few chunk sizes).
  c.train.loss_chunk_tokens = 2048
  c.decode.temperature = 0.8
  c.decode.top_k = 40
  return apply_preset(c, PRESETS)
