"""pstar_fx: train models far larger than device memory, planned from the graph of the training step."""
__version__ = "0.1.0"
