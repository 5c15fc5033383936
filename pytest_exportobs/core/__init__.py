"""Helpers below every layer: pytrees of transformers caches, ``string_type``, text, files, versions.

Nothing here knows about observations, shapes, exports or pytest.
"""
