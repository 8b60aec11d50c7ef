"""trainguard: keeps large PyTorch training jobs alive through failures."""

__version__ = "0.1.0"
