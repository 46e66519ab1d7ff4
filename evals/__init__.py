"""Evaluation of trained runs by the field's harnesses: EleutherAI's lm-evaluation-harness
(`lm-eval`) on decoder runs (docs/families/gpt.md, "Scoring a run with lm-eval").

  harness.py  the harness's model of a run ('attention_lineage'), and its task manager
  runner.py   --mode=lm_eval: tasks checked, the run scored, the results JSON written into the run
  during_training.py  train.eval_tasks: the same checks before a training, and the scorer of the live
              model that launch.py hands the trainer (train/downstream.py calls it)
  tasks/      the repository's own tasks: task YAMLs over JSONL files (multiple choice, rolling
              perplexity, generation), read with no network

Evaluation stands above training: it loads runs through `train.rundir.load_run` and may import
`train/` and the layers below it; nothing below it imports it (tests/test_layering.py).
"""
