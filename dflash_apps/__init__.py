"""dflash_apps: the applications built on the DFlash runtime (``dflash``), kept apart from it.

* :mod:`dflash_apps.cli` — the ``dflash`` console command and its subcommands;
* :mod:`dflash_apps.zlab_cli` — z-lab's ``dflash generate`` / ``dflash benchmark``;
* :mod:`dflash_apps.demo` — the offline SmolLM2-135M demo (``dflash demo``, ``make demo``);
* :mod:`dflash_apps.smollm2` — the loader of the embedded SmolLM2-135M-Instruct target;
* :mod:`dflash_apps.train` — draft training (``dflash train``);
* ``assets/`` — the shipped SmolLM2 draft, the evaluation prompts and the kept target responses.

The layers point one way: ``dflash_apps`` imports the runtime ``dflash`` and the ops library ``dflash_kernels``;
neither of those imports ``dflash_apps``, so the runtime installs and runs without the apps' assets or data.
"""
