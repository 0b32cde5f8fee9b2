"""``from gradwatch.hf import GradWatchCallback``: the public home of the Hugging Face Trainer callback
(implemented in :mod:`gradwatch.integrations.hf`; importing this module imports transformers)."""

from .integrations.hf import GradWatchCallback

__all__ = ["GradWatchCallback"]
