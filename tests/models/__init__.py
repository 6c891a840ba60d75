"""Tests of gspo_lightning.models."""
