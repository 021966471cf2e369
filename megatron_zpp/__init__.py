"""megatron_zpp: communication-compressed 3D-parallel LLM training on Megatron-Core.

Layers, each importing only the ones before it:
``compression`` (codecs and kernels) -> ``comm`` -> ``policy`` -> ``megatron`` hooks -> ``training``.
"""

__version__ = "0.1.0"
