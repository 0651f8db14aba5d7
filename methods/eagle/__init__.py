"""EAGLE-style drafting: a trained draft head (head.py) and the drafter that grows trees with it (drafter.py)."""

from methods.eagle.drafter import Eagle
from methods.eagle.head import EagleHead, HeadError, load_head

__all__ = ["Eagle", "EagleHead", "HeadError", "load_head"]
