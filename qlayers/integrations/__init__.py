"""Bridges to other JAX libraries, each an optional extra.

* `qlayers.integrations.tunix`: Tunix (``pip install 'qlayers[tunix]'``):
  its models converted with qlayers' quantized GEMMs, and its PEFT/SFT
  trainer with delayed scaling ended at every step.

Nothing here is imported by ``import qlayers``.
"""
