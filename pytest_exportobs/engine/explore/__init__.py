"""Beyond the recorded calls: shapes the tests never used (entry point:
:func:`.variations.explore`), and the first ONNX op of a mismatch (:func:`.localize.localize_call`)."""
