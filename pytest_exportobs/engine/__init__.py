"""The engine: from one model's observations to a verdict (export, verify, explore, repro).

``result`` is pure Python; every other module imports torch.
"""
