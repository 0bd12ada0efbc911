"""Plumbing shared by the lessons: launch detection, data, model, metrics, checkpoints, logging.

The ideas each lesson teaches (init, sampler, wrap, all_reduce, save on rank 0) stay in the
lesson scripts themselves; this package only keeps them short.
"""
