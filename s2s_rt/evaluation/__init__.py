"""The answer-quality evaluation: questions, voices, grading, and the run that measures each LLM preset.

``python -m s2s_rt.evaluation --help``; see :mod:`s2s_rt.evaluation.cli`.
"""
