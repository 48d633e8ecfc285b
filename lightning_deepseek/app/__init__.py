"""The application: ``lds-train`` (a Hydra app training the example GPT with every component), ``lds-sample`` and
the calibration ``lds-train tune=...`` (:mod:`~lightning_deepseek.app.tune`); its Hydra configs are in ``conf/``.

It imports the library; the library never imports it (an import-linter contract, checked in CI).
"""
