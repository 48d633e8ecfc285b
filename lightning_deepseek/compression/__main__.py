"""``python -m lightning_deepseek.compression``: build the native CPU quantization kernels now (see ``native.py``)."""

from lightning_deepseek.compression.native import main

main()
