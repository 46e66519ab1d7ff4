"""notebooks/reload_and_inspect.ipynb runs top to bottom (nbclient, python3 kernel) against a tiny
GPT run trained here, printing its predictions and drawing attention heatmaps inline."""
import base64
import os

import nbformat
import pytest
from nbclient import NotebookClient

import support

NOTEBOOK = os.path.join(support.REPO, 'notebooks', 'reload_and_inspect.ipynb')


@pytest.fixture(scope='module')
def tiny_run(tmp_path_factory):
  # One block: the notebook's kernel traces, decodes and runs eagerly (op by op) every layer; its last layer,
  # the one the heatmaps show, is there all the same.
  from train.trainer import train_and_evaluate
  root = tmp_path_factory.mktemp('notebook')
  config = support.tiny_gpt_config(support.write_corpus(str(root / 'corpus'), files=3, lines=40),
                                   **{'train.steps': 4, 'train.eval_every': 4, 'train.checkpoint_every': 4,
                                      'decode.max_new_tokens': 6, 'model.num_layers': 1})
  train_and_evaluate(config, str(root / 'run'))
  return str(root / 'run')


def test_notebook_runs_top_to_bottom_on_a_finished_run(tiny_run, monkeypatch):
  monkeypatch.setenv('RUN_DIR', tiny_run)
  monkeypatch.setenv('REPO_DIR', support.REPO)
  # Two inputs of one length (10 characters, the tiny GPT's tokens): the second heatmap's eager ops run the
  # programs the first compiled.
  monkeypatch.setenv('INPUTS', 'alpha beta|gamma zeta')
  monkeypatch.setenv('XLA_FLAGS', support.xla_flags(1))
  notebook = nbformat.read(NOTEBOOK, as_version=4)
  NotebookClient(notebook, kernel_name='python3', timeout=120,
                 resources={'metadata': {'path': os.path.dirname(NOTEBOOK)}}).execute()
  outputs = [o for cell in notebook.cells if cell.cell_type == 'code' for o in cell.get('outputs', [])]
  text = ''.join(o.get('text', '') for o in outputs if o.output_type == 'stream')
  assert 'gpt (tiny) at step 4' in text and '>>> alpha beta' in text and '>>> gamma zeta' in text
  images = [o for o in outputs if o.output_type == 'display_data' and 'image/png' in o.data]
  assert len(images) == 2
  assert base64.b64decode(images[0].data['image/png'])[:8] == b'\x89PNG\r\n\x1a\n'
  assert os.path.exists(os.path.join(tiny_run, 'notebook_attention_1.png'))
