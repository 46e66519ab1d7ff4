"""A bad Hugging Face directory given to --mode=import_hf ends with one `error:` line naming the
file and the fix, exit status 1, and no --workdir written, whichever reader (GPT-2, Llama, Mixtral,
Qwen3-MoE, BERT) and whichever part is bad: config.json (cut short, sizes missing, no model_type,
an option this GPT lacks: a sliding window, Qwen3-MoE's mlp_only_layers), the weights (missing,
damaged, tensors missing, extra or of the wrong shape), the tokenizer (missing, not loading, not a
BERT vocabulary).

The directories are written by our own exporters (no torch needed) and then broken one way each.
Each case runs in this process what launch.py runs for it after parsing its flags (`import_hf_as_launch_does`);
one case goes through a real launch.py process for the exit status and the stderr it prints."""
import json
import os
import re
import shutil

import numpy as np
import pytest
from flax import nnx

import support

WORDS = ' '.join(support.WORDS)


@pytest.fixture(scope='module')
def hf_dirs(tmp_path_factory):
  """{'gpt2' | 'llama' | 'mixtral' | 'qwen3_moe' | 'bert': a complete tiny Hugging Face directory of
  that model_type}."""
  from data.tokenizers import train_bpe, train_wordpiece
  from interop.hf_bert import export_bert
  from interop.hf_gpt2 import export_gpt2
  from interop.hf_llama import LLAMA_STEPS, export_llama
  from interop.hf_moe import export_moe
  from models.bert import BertConfig, BertForPretraining
  from models.gpt import GPT, GPT2Config
  root = tmp_path_factory.mktemp('hf')
  # Any weights do: the models are built abstractly and valued by NumPy (no initialiser compiled).
  gpt = lambda config: support.numpy_valued(nnx.eval_shape(lambda: GPT(config, rngs=nnx.Rngs(0))))
  bpe = train_bpe([WORDS] * 4, vocab_size=300)
  sizes = dict(vocab_size=bpe.vocab_size, max_len=16, num_layers=1, num_heads=2, width=8)
  export_gpt2(gpt(GPT2Config(**sizes)), bpe, str(root / 'gpt2'))
  export_llama(gpt(GPT2Config(**sizes, **LLAMA_STEPS, use_bias=False)), bpe, str(root / 'llama'))
  experts = dict(sizes, **LLAMA_STEPS, use_bias=False, moe_experts=3, moe_hidden=4)
  export_moe(gpt(GPT2Config(**experts)), bpe, str(root / 'mixtral'))
  # Experts in block 1 of 2 (decoder_sparse_step=2), QK-norm.
  qwen3_moe = GPT2Config(**{**experts, 'num_layers': 2}, moe_every=2, qk_norm=True)
  export_moe(gpt(qwen3_moe), bpe, str(root / 'qwen3_moe'))
  wordpiece = train_wordpiece([WORDS] * 4, vocab_size=100)
  bert = BertConfig(vocab_size=wordpiece.vocab_size, max_len=16, num_layers=1, num_heads=2, width=8, mlp_dim=16)
  export_bert(support.numpy_valued(nnx.eval_shape(lambda: BertForPretraining(bert, rngs=nnx.Rngs(0)))), wordpiece,
              str(root / 'bert'))
  return {name: str(root / name) for name in ('gpt2', 'llama', 'mixtral', 'qwen3_moe', 'bert')}


# Each way of breaking a directory `d`, and the error it must give ({d}: the directory, ...: the
# words of the library that failed to read it).
def config_with_only_model_type(d):
  model_type = json.load(open(f'{d}/config.json'))['model_type']
  json.dump({'model_type': model_type}, open(f'{d}/config.json', 'w'))


def config_cut_short(d):
  text = open(f'{d}/config.json').read()
  open(f'{d}/config.json', 'w').write(text[:len(text) // 2])


def config_without_model_type(d):
  config = json.load(open(f'{d}/config.json'))
  del config['model_type']
  json.dump(config, open(f'{d}/config.json', 'w'))


def without(name):
  def remove(d):
    os.remove(f'{d}/{name}')
  return remove


def weights_cut_short(d):
  data = open(f'{d}/model.safetensors', 'rb').read()
  open(f'{d}/model.safetensors', 'wb').write(data[:100])


def edit_weights(edit):
  def rewrite(d):
    from safetensors.numpy import load_file, save_file
    tensors = load_file(f'{d}/model.safetensors')
    edit(tensors)
    save_file(tensors, f'{d}/model.safetensors')
  return rewrite


def edit_config(**entries):
  def rewrite(d):
    config = json.load(open(f'{d}/config.json'))
    json.dump({**config, **entries}, open(f'{d}/config.json', 'w'))
  return rewrite


def vocabulary_one_larger(d):
  config = json.load(open(f'{d}/config.json'))
  json.dump({**config, 'vocab_size': config['vocab_size'] + 1}, open(f'{d}/config.json', 'w'))


def tokenizer_json_of_another_format(d):
  json.dump({'version': '1.0', 'model': 3}, open(f'{d}/tokenizer.json', 'w'))


def vocab_txt_without_special_tokens(d):
  os.remove(f'{d}/tokenizer.json')
  open(f'{d}/vocab.txt', 'w').write('\n'.join(support.WORDS) + '\n')


CASES = {
    'llama config.json with model_type alone': (
        'llama', config_with_only_model_type,
        "{d}/config.json lacks vocab_size, max_position_embeddings, num_hidden_layers, num_attention_heads, "
        "hidden_size, intermediate_size: the model's sizes. A complete Hugging Face config.json has them all; "
        "download it again."),
    'gpt2 config.json with model_type alone': (
        'gpt2', config_with_only_model_type,
        "{d}/config.json lacks vocab_size, n_positions, n_layer, n_head, n_embd: the model's sizes. A complete "
        "Hugging Face config.json has them all; download it again."),
    'bert config.json with model_type alone': (
        'bert', config_with_only_model_type,
        "{d}/config.json lacks vocab_size, num_hidden_layers, num_attention_heads, hidden_size, intermediate_size: "
        "the model's sizes. A complete Hugging Face config.json has them all; download it again."),
    'config.json cut short': (
        'gpt2', config_cut_short,
        '{d}/config.json is not valid JSON (...); it should hold a Hugging Face model config: download it again.'),
    'config.json without model_type': (
        'bert', config_without_model_type,
        "{d}/config.json names no model_type; pass the config of its family, one of ['configs/bert.py', "
        "'configs/gpt.py']."),
    'no weights file': (
        'bert', without('model.safetensors'),
        'No weights in {d}: expected model.safetensors or pytorch_model.bin (or their sharded .index.json forms and '
        'every shard they name).'),
    'weights file cut short': (
        'llama', weights_cut_short,
        '{d}/model.safetensors is not a readable safetensors file (...); download it again.'),
    'a tensor missing': (
        'gpt2', edit_weights(lambda tensors: tensors.pop('transformer.ln_f.bias')),
        "The weights in {d} lack the tensor 'ln_f.bias' that its config.json implies; the weights and config.json "
        "are not of one model."),
    'a tensor too many': (
        'bert', edit_weights(lambda tensors: tensors.update({'bert.extra.weight': np.zeros(3, np.float32)})),
        "The weights in {d} hold tensors that its config.json gives no place: ['extra.weight']; the weights and "
        "config.json are not of one model."),
    'a tensor of another shape': (
        'llama', vocabulary_one_larger,
        'The tensor model.embed_tokens.weight in {d} is [{vocab}, 8], but its config.json implies [{vocab1}, 8]; '
        'the weights and config.json are not of one model.'),
    'mixtral sliding window shorter than the positions': (
        'mixtral', edit_config(sliding_window=8),
        '{d}/config.json: sliding_window=8 is shorter than max_position_embeddings=16, and this GPT attends to '
        'every earlier token; to import it for sequences of at most 8 tokens (where the window cuts nothing), set '
        'max_position_embeddings to 8.'),
    'qwen3_moe mlp_only_layers not expressible with decoder_sparse_step': (
        'qwen3_moe', edit_config(mlp_only_layers=[0, 1]),
        '{d}/config.json: mlp_only_layers=[0, 1] makes blocks [1] dense, which decoder_sparse_step=2 gives experts; '
        'this GPT places experts only every moe_every-th block (decoder_sparse_step), so such a model cannot be '
        'imported.'),
    'qwen3_moe attention biases': (
        'qwen3_moe', edit_config(attention_bias=True),
        '{d}/config.json: attention_bias=true is not supported for Qwen3-MoE (its MLPs have no biases, and this GPT '
        'has one use_bias for both).'),
    'qwen3_moe more experts per token than experts': (
        'qwen3_moe', edit_config(num_experts_per_tok=4),
        '{d}/config.json: num_experts_per_tok=4 must be between 1 and the 3 experts; the config.json is damaged: '
        'download it again.'),
    'mixtral config.json without its experts': (
        'mixtral', edit_config(num_local_experts=None),
        '{d}/config.json lacks num_local_experts (or num_experts) or num_experts_per_tok: the experts of a mixture '
        'of experts. A complete Hugging Face config.json has them; download it again.'),
    "an expert's tensor missing": (
        'mixtral', edit_weights(lambda tensors: tensors.pop('model.layers.0.block_sparse_moe.experts.2.w3.weight')),
        "The weights in {d} lack the tensor 'model.layers.0.block_sparse_moe.experts.2.w3.weight' that its "
        "config.json implies; the weights and config.json are not of one model."),
    'an expert too many': (
        'qwen3_moe', edit_weights(lambda tensors: tensors.update(
            {'model.layers.1.mlp.experts.3.up_proj.weight': np.zeros((4, 8), np.float32)})),
        "The weights in {d} hold tensors that its config.json gives no place: "
        "['model.layers.1.mlp.experts.3.up_proj.weight']; the weights and config.json are not of one model."),
    'tokenizer.json that does not load': (
        'gpt2', tokenizer_json_of_another_format,
        '{d}/tokenizer.json does not load as a tokenizer (...); download it again.'),
    'vocab.txt without the special tokens': (
        'bert', vocab_txt_without_special_tokens,
        '{d}/vocab.txt lacks the special token [UNK]; it is not a BERT vocabulary.'),
    'no tokenizer': (
        'llama', without('tokenizer.json'),
        'No tokenizer in {d}: expected tokenizer.json or vocab.json + merges.txt.'),
}


def import_hf_as_launch_does(hf_dir: str, workdir: str) -> None:
  """`launch.py --mode=import_hf --hf_dir=<hf_dir> --workdir=<workdir>` without --config, in this process:
  the config its config.json's model_type names (launch.config_spec), the family check, the import.
  A user's mistake raises errors.UserError, whose message launch.py prints as its one `error:` line."""
  import launch
  from train.trainer import import_hf_run
  config = launch.load_config(launch.hf_import_configs().get(launch.hf_model_type(hf_dir), 'configs/default.py'))
  launch.check_import_family(hf_dir, config.family)
  import_hf_run(config, hf_dir, workdir)


def broken_copy(hf_dirs, tmp_path, case) -> tuple[str, str]:
  """(a copy of the case's directory, broken as the case says; the error line launch.py must print for it)."""
  model_type, breaks, message = CASES[case]
  directory = str(tmp_path / 'hf')
  shutil.copytree(hf_dirs[model_type], directory)
  vocab = json.load(open(f'{directory}/config.json'))['vocab_size']
  breaks(directory)
  return directory, 'error: ' + message.format(d=directory, vocab=vocab, vocab1=vocab + 1)


def assert_matches(line: str, expected: str) -> None:
  """`line` is `expected`, each '...' of it standing for any text."""
  assert re.fullmatch('.+'.join(map(re.escape, expected.split('...'))), line), (line, expected)


@pytest.mark.parametrize('case', list(CASES))
def test_a_bad_hf_directory_is_one_error_and_no_workdir(hf_dirs, tmp_path, case, capfd):
  from errors import UserError
  directory, expected = broken_copy(hf_dirs, tmp_path, case)
  workdir = tmp_path / 'run'
  capfd.readouterr()
  with pytest.raises(UserError) as error:
    import_hf_as_launch_does(directory, str(workdir))
  assert_matches(f'error: {error.value}', expected)
  assert capfd.readouterr().err == ''  # nothing else on stderr beside launch.py's line
  assert not workdir.exists()


def test_a_bad_hf_directory_ends_launch_with_one_line_and_exit_status_1(hf_dirs, tmp_path):
  """Through launch.py: a tensor of another shape is found after the config, the tokenizer and the
  weights file are read, so any other line those print would be on stderr too."""
  directory, expected = broken_copy(hf_dirs, tmp_path, 'a tensor of another shape')
  workdir = tmp_path / 'run'
  result = support.launch(['--mode=import_hf', f'--hf_dir={directory}', f'--workdir={workdir}'])
  assert result.returncode == 1, result.stderr[-2000:]
  lines = result.stderr.strip().splitlines()
  assert len(lines) == 1, result.stderr[-2000:]
  assert_matches(lines[0], expected)
  assert not workdir.exists()
