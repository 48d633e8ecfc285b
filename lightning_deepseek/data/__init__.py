from lightning_deepseek.data.text import DataError, TextDataModule, read_corpus

__all__ = ["DataError", "TextDataModule", "read_corpus"]
