"""The run config: its typed sections (``run``), the one parser for command lines and config files
(``cli``), and each launcher's complete config (``recipes``).
"""
