"""The sandbox launcher, run as ``python -I -S <this folder>``; see ``__main__.py``.

Its modules import each other by plain names (this folder is the launcher's ``sys.path[0]``), so the trainer
imports only ``wire``, which imports nothing of them.
"""
