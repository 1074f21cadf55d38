"""Workflows that loop back into recording: the perturbation estimate, the localization replay, adaptive capture.

Imports every stage; no stage imports it.
"""
