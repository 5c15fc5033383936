"""What every stage of a check shares: ``result`` and ``settings`` (pure Python: the plugin reads
them without torch), the model's own call (``eager``), the user's source lines behind an error
or an ONNX node (``frames``, ``origins``, ``reasons``), the machine's problems (``environment``)."""
