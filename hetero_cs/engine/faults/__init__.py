"""Failing cards: a device error retried then set aside (``failover``), backups that let a restarted script resume
at the exact step (``backup``), profiles kept across restarts (``restart_profiles``), and what a script shares with
``hetero-cs run`` (``supervised_run``: the environment and the backups' files; it loads no TensorFlow, so the
supervisor can read it).

This package may import :mod:`hetero_cs.engine.step`, :mod:`hetero_cs.engine._compat`, :mod:`calibration` and the
layers below them (planning, devices). Nothing is imported here.
"""
