"""Observation: record a model's calls, align them on flat inputs, group them per model."""
