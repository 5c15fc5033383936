"""Every unstable surface the plugin touches, in one layer below all the others.

* :mod:`.torch_private`: private torch names (the exporter's two steps, capture settings, the RNN
  decompositions, torch.export's user error, fake tensors);
* :mod:`.torch_text`: parsers of the text torch writes (its error messages, the records of its
  symbolic-shapes logger);
* :mod:`.onnxscript_private`: the rewrite rules of onnxscript's optimizer;
* :mod:`.onnxruntime_text`: parsers of onnxruntime's errors (a missing kernel);
* :mod:`.export_patches`: patches of torch and transformers internals around ``torch.export``;
* :mod:`.transformers_hooks`: transformers' own forward hooks, set aside while a model is pickled;
* :mod:`.xdist_private`: the private hooks of xdist's scheduler.

A release that changes one of them breaks this package alone; ``tests/unit/test_compat.py``
checks each name against the installed versions and each parser on messages captured from
every supported torch.
"""
