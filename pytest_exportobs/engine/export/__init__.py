"""Export a graph: torch.export with the inferred dims, then ONNX, stage by stage, the export
cache asked at each (entry point: :func:`.pipeline.export_model`)."""
