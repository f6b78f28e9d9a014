"""clinfed: federated training of clinical NLP models with privacy accounting."""

__version__ = "0.1.0"
