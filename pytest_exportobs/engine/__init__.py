"""The engine: from one model's observations to a verdict.

The check of a model (:func:`~.check.check_model`) plans its graphs (:mod:`.planning`) and runs
each through :class:`~.graph.GraphCheck`, which drives the stages, one sub-package each:

- :mod:`.export`: torch.export, then ONNX (``export_model``), with the export cache;
- :mod:`.verify`: the graph against eager on every recorded call (``verify_calls``);
- :mod:`.explore`: beyond the recorded calls: shapes the tests never used (``explore``), and the
  first op of a mismatch (``localize``);
- :mod:`.base`, below them all: the result and settings types (pure Python), the model's own
  call, the user's source lines, the machine's problems.

:mod:`.runner` checks many models (in process or forked); :mod:`.repro` writes a failing graph's
script.  Each sub-package imports only those listed after it.
"""
