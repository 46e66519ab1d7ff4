"""scripts/make_gettext_corpus.py on small .mo catalogs written here in the binary format."""
import os
import struct

import support

HEADER = 'Content-Type: text/plain; charset=UTF-8\nPlural-Forms: nplurals=2; plural=(n != 1);\n'


def load_script():
  return support.load_file('scripts/make_gettext_corpus.py')


def write_mo(path, messages: dict[str, str]) -> None:
  """A GNU .mo catalog: a 7-word header, the (length, offset) tables of the msgids (sorted) and of
  their msgstrs, then the NUL-terminated strings. No hash table (gettext does not need one)."""
  keys = sorted(message.encode() for message in messages)
  values = [messages[key.decode()].encode() for key in keys]
  count = len(keys)
  strings_start = 28 + 16 * count
  tables, strings = [], b''
  for items in (keys, values):
    table = []
    for item in items:
      table += [len(item), strings_start + len(strings)]
      strings += item + b'\0'
    tables += table
  header = struct.pack('<7I', 0x950412de, 0, count, 28, 28 + 8 * count, 0, 0)
  with open(path, 'wb') as f:
    f.write(header + struct.pack(f'<{4 * count}I', *tables) + strings)


def catalogs(directory):
  os.makedirs(directory)
  first = {'': HEADER, 'Open': 'Abrir', 'Save\nthe  file': 'Guardar\n  el archivo',
           'One file\0%d files': 'Un archivo\0%d archivos', 'menu\x04Quit': 'Salir', 'Name\tValue': 'Nombre\tValor',
           'Space': ' ', 'Close': 'Cerrar', **{f'Message {i}': f'Mensaje {i}' for i in range(20)}}
  second = {'': HEADER, 'Open': 'Abrir', 'Close': 'Cierra'}
  write_mo(os.path.join(directory, 'first.mo'), first)
  write_mo(os.path.join(directory, 'second.mo'), second)
  with open(os.path.join(directory, 'broken.mo'), 'wb') as f:
    f.write(b'not a catalog')
  return os.path.join(directory, '*.mo')


def read(directory):
  """{split: pairs} of the script's files, each line the source<TAB>target pair data/translation.py reads."""
  splits = {}
  for name in ('train', 'valid', 'test'):
    with open(os.path.join(directory, f'{name}.tsv'), encoding='utf-8') as f:
      splits[name] = [tuple(line.split('\t')) for line in f.read().split('\n') if line]
    assert all(len(pair) == 2 and all(side.strip() == side and side for side in pair) for pair in splits[name])
  return splits


def test_pairs_are_cleaned_deduplicated_and_split_by_english_message(tmp_path, capsys):
  script = load_script()
  pattern = catalogs(str(tmp_path / 'catalogs'))
  out = str(tmp_path / 'corpus')
  counts = script.main(['--catalogs', pattern, '--out_dir', out, '--valid_size', '3', '--test_size', '4'])
  assert counts == {'unreadable catalogs': 1, 'catalogs': 2, 'messages': 29, 'with a tab or an empty side': 2,
                    'unique pairs': 26, 'train': 19, 'valid': 3, 'test': 4}
  assert 'train: 19\nvalid: 3\ntest: 4\n' in capsys.readouterr().out
  splits = read(out)
  assert {name: len(pairs) for name, pairs in splits.items()} == {'train': 19, 'valid': 3, 'test': 4}
  pairs = [pair for part in splits.values() for pair in part]
  assert sorted(pairs) == sorted([('Open', 'Abrir'), ('Save the file', 'Guardar el archivo'),
                                  ('One file', 'Un archivo'), ('Quit', 'Salir'), ('Close', 'Cerrar'),
                                  ('Close', 'Cierra')] + [(f'Message {i}', f'Mensaje {i}') for i in range(20)])
  # Both translations of 'Close' are in one file: no English message is both trained on and held out.
  english = {name: {s for s, _ in part} for name, part in splits.items()}
  assert not english['train'] & english['valid'] and not english['train'] & english['test']
  assert not english['valid'] & english['test']
  # The seed fixes the order; another seed gives another one.
  again = str(tmp_path / 'again')
  script.main(['--catalogs', pattern, '--out_dir', again, '--valid_size', '3', '--test_size', '4'])
  assert read(again) == splits
  other = str(tmp_path / 'other')
  script.main(['--catalogs', pattern, '--out_dir', other, '--valid_size', '3', '--test_size', '4', '--seed', '1'])
  assert read(other)['test'] != splits['test']
