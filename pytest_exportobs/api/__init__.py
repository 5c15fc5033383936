"""The library API under the peers' names (torch.onnx's ``InputObserver``, onnx-diagnostic's
helpers): a façade over the observe, shapes and engine layers."""
