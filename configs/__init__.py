"""Experiment configs (ml_collections); base.py holds the defaults and the validation."""
