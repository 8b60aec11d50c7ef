"""trainguard: keeps large PyTorch training jobs alive through failures."""

# The one version of the release: the wheel's metadata reads it (pyproject.toml), and the image's
# tag and VERSION build argument must say the same (tests/unit/test_release.py).
__version__ = "0.2.0"
