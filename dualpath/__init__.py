"""dualpath: prefill/decode-disaggregated LLM inference with dual KV-cache loading paths.

Importing the package is cheap: it pulls in no optional backend and no torch.
"""

__version__ = "0.1.0"
