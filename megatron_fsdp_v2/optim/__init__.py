"""Optimizers that need more than a rank's rows of a parameter: ``Muon`` (muon.py)."""

from .muon import Muon

__all__ = ["Muon"]
