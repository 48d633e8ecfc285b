"""``python -m lightning_deepseek.elastic.controller``: the ``lds-elastic`` program."""

from lightning_deepseek.elastic.controller.controller import main

main()
