#!/usr/bin/env python3
"""Reference: HF transformers LlamaForCausalLM on CPU (PyTorch, fp32) at the `llama-bench` shapes.

The counterpart of /work/shared/reference-bench/ref_gpt_train.py and ref_gpt_generate.py for
`configs/gpt.py:llama-bench`: 6 layers, 384 wide, 6 query heads and 2 key/value heads, SwiGLU
1,024 wide, RoPE (theta 10,000), RMSNorm, no biases, tied embeddings, vocabulary 8,192.
Random weights from a config object, random token ids, no downloads; one JSON line per result.

  python scripts/ref_llama.py train      # tokens_per_s, batch 8 x 256, AdamW
  python scripts/ref_llama.py generate   # new_tokens_per_s at batch 1 and 8: prompt 16, 128 new, greedy, KV cache

FLOPs/token (train) = 6 * non-embedding params + 12 * layers * seq * width (+ 6 * width * vocab
for the tied LM head), as the GPT reference and train/tasks/gpt.py count them.
"""
import argparse
import json
import statistics
import time


def build(args, torch, transformers):
  config = transformers.LlamaConfig(
      vocab_size=args.vocab, hidden_size=args.width, intermediate_size=args.mlp_hidden, num_hidden_layers=args.layers,
      num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, max_position_embeddings=args.max_len,
      rms_norm_eps=1e-5, tie_word_embeddings=True, attention_bias=False, mlp_bias=False,
      bos_token_id=None, eos_token_id=None, pad_token_id=0)
  config._attn_implementation = args.attn
  torch.manual_seed(0)
  return transformers.LlamaForCausalLM(config)


def train(args, torch, model):
  model.train()
  optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.0)
  tokens = torch.randint(0, args.vocab, (args.batch, args.seq))

  def step():
    optimizer.zero_grad(set_to_none=True)
    loss = model(input_ids=tokens, labels=tokens).loss
    loss.backward()
    optimizer.step()
    return float(loss.detach())

  for _ in range(args.warmup):
    step()
  rates = []
  for _ in range(args.steps):
    start = time.perf_counter()
    step()
    rates.append(args.batch * args.seq / (time.perf_counter() - start))
  total = sum(p.numel() for p in model.parameters())  # the tied head counted once
  non_embedding = total - model.model.embed_tokens.weight.numel()
  flops = 6 * non_embedding + 12 * args.layers * args.seq * args.width
  print(json.dumps({'bench': 'hf_llama_train', 'tokens_per_s': round(statistics.median(rates), 1),
                    'tokens_per_s_min_max': [round(min(rates), 1), round(max(rates), 1)], 'n_params_total': total,
                    'flops_per_token': flops, 'flops_per_token_w_lmhead': flops + 6 * args.width * args.vocab,
                    'batch': args.batch, 'seq': args.seq, 'attn': args.attn, 'threads': torch.get_num_threads(),
                    'torch': torch.__version__}), flush=True)


def generate(args, torch, model):
  model.eval()
  for batch in (int(b) for b in args.batches.split(',')):
    prompt = torch.randint(0, args.vocab, (batch, args.prompt))

    def run():
      with torch.inference_mode():
        return model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=args.new,
                              min_new_tokens=args.new, do_sample=False, use_cache=True)
    assert run().shape == (batch, args.prompt + args.new)  # warm-up, and every row ran to the end
    rates = []
    for _ in range(args.reps):
      start = time.perf_counter()
      run()
      rates.append(batch * args.new / (time.perf_counter() - start))
    print(json.dumps({'bench': 'hf_llama_generate', 'batch': batch,
                      'new_tokens_per_s': round(statistics.median(rates), 1),
                      'new_tokens_per_s_min_max': [round(min(rates), 1), round(max(rates), 1)],
                      'prompt_len': args.prompt, 'new_tokens': args.new, 'attn': args.attn,
                      'threads': torch.get_num_threads(), 'torch': torch.__version__}), flush=True)


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument('what', choices=['train', 'generate'])
  parser.add_argument('--layers', type=int, default=6)
  parser.add_argument('--width', type=int, default=384)
  parser.add_argument('--heads', type=int, default=6)
  parser.add_argument('--kv-heads', type=int, default=2)
  parser.add_argument('--mlp-hidden', type=int, default=1024)
  parser.add_argument('--vocab', type=int, default=8192)
  parser.add_argument('--max-len', type=int, default=256)
  parser.add_argument('--batch', type=int, default=8)
  parser.add_argument('--seq', type=int, default=256)
  parser.add_argument('--warmup', type=int, default=3)
  parser.add_argument('--steps', type=int, default=15)
  parser.add_argument('--batches', default='1,8')
  parser.add_argument('--prompt', type=int, default=16)
  parser.add_argument('--new', type=int, default=128)
  parser.add_argument('--reps', type=int, default=5)
  parser.add_argument('--attn', default='sdpa', choices=['sdpa', 'eager'])
  parser.add_argument('--threads', type=int, default=2)
  args = parser.parse_args()
  import torch
  import transformers
  torch.set_num_threads(args.threads)
  model = build(args, torch, transformers)
  (train if args.what == 'train' else generate)(args, torch, model)


if __name__ == '__main__':
  main()
