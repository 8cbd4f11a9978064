"""Checkpoints: where they come from (``sources``), how they are read (``safetensors_io``), the low-precision
formats inside them (``formats``), checks against a recipe (``check``) and the quantization tool
(``quantize``)."""
