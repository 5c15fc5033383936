"""The library API (the seed's names): a façade over the observe, shapes and engine layers."""
