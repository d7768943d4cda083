"""Distil a small draft from a target: data collection, training, evaluation, export."""
