"""The gate: the baseline file, the judgement of a session against it, JSON and Markdown reports.

Pure Python: the xdist controller judges and reports without importing torch.
"""
