"""Verify a graph against eager on every recorded call: the references, what runs the graph,
the comparison within tolerance (entry point: :func:`.compare.verify_calls`)."""
