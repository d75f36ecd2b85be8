"""DFlash draft training (paper §4.2 / app. A.1): data from the target's own responses, packed
anchor blocks with a block mask, position-weighted cross-entropy, AdamW + cosine schedule.

Entry point ``main(argv)`` (also ``dflash train …`` and ``python -m dflash_apps.train …``):

* ``data``  — build the offline prompt set and generate the target's greedy responses + features
  (``--responses FILE``: check responses kept in the repository instead of generating them, record new ones)
* ``fit``   — train a draft on a generated data folder (resumable from its checkpoint folder)
* ``export``— write a checkpoint as a z-lab draft folder (bf16)
* ``evaluate`` — teacher-forced acceptance estimate of a draft on a data folder (``--tree-budgets 7,15``: also
  of draft trees of those budgets, built and walked by the engine's own ops; ``fit --eval-tree-budgets`` logs
  them at every eval)
* ``vocab`` — give a draft a vocabulary subset: the most frequent response tokens of the data
"""
from __future__ import annotations


def main(argv=None) -> int:
    from dflash_apps.train.cli import main as _main

    return _main(argv)
